// Decode rows split along their keys (flash-decoding), for batches with fewer decode rows than two per
// thread: each row's keys 0..position form `parts` stretches, every stretch its own work item, and a second
// pass merges the stretches' softmax maxima, sums and weighted values. Included by paged_attention.cpp.
//
// Without it a batch-1 row was one item per KV head: three items on two threads left one thread idle for a
// third of the call, and each item pulled a third of every cache slot (a slot holds the KV heads side by
// side), so the row's cache lines came in about three times over (bundled model, ~2,000 keys: 277-283 us a
// layer, against 178-183 split into stretches of whole slots).
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>

#include "online_softmax.h"

namespace attn_split {

constexpr int64_t kMinKeys = 64;  // the fewest keys per stretch

// Stretches per row: enough items for about four per thread, each at least kMinKeys long; 1 (no split) on
// one thread or where some row is not a decode row. items_per_stretch: items a row's stretch makes (1 when
// it reads whole slots, else one per KV head); max_keys: the longest row's keys.
inline int64_t parts(int64_t threads, int64_t decode_rows, int64_t rows, int64_t items_per_stretch,
                     int64_t max_keys) {
  if (threads < 2 || decode_rows == 0 || decode_rows != rows) return 1;
  const int64_t per_stretch = decode_rows * items_per_stretch;
  return std::max<int64_t>(1, std::min((4 * threads + per_stretch - 1) / per_stretch, max_keys / kMinKeys));
}

// Stretch `part` of `parts` of keys first..last, narrowed in place; false when it holds no key.
inline bool narrow(int64_t& first, int64_t& last, int64_t part, int64_t parts) {
  const int64_t keys = last + 1 - first, a = first + keys * part / parts;
  last = first + keys * (part + 1) / parts - 1;
  first = a;
  return first <= last;
}

// One stretch's results as the merge reads them: nq maxima, nq sums, then nq x D weighted values.
inline int64_t stride(int64_t nq, int64_t D) { return nq * (D + 2); }

// An empty stretch: a maximum of -inf weighs it out of the merge.
inline void store_empty(float* out, int64_t nq, int64_t D) {
  std::fill(out, out + nq, -std::numeric_limits<float>::infinity());
  std::fill(out + nq, out + stride(nq, D), 0.f);
}

inline void store(float* out, int64_t nq, int64_t D, const float* m, const float* l, const float* acc) {
  std::copy(m, m + nq, out);
  std::copy(l, l + nq, out + nq);
  std::copy(acc, acc + nq * D, out + 2 * nq);
}

// The `parts` stretches at pp (one stride apart) -> m, l, acc as one item over all the keys would hold them:
// sums rescaled to the largest maximum.
inline void merge(const float* pp, int64_t parts, int64_t nq, int64_t D, float* m, float* l, float* acc) {
  const int64_t st = stride(nq, D);
  for (int64_t g = 0; g < nq; ++g) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t part = 0; part < parts; ++part) mx = std::max(mx, pp[part * st + g]);
    m[g] = mx;
    l[g] = 0.f;
    float* a = acc + g * D;
    std::fill(a, a + D, 0.f);
    for (int64_t part = 0; part < parts; ++part) {
      const float* q = pp + part * st;
      const float c = exp_nonpositive(q[g] - mx);
      l[g] += q[nq + g] * c;
      const float* pa = q + 2 * nq + g * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] += pa[i] * c;
    }
  }
}

}  // namespace attn_split
