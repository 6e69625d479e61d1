// Pieces of the attention kernels' online softmax (paged_attention.cpp, attention_amx.h).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

// 2^f for f in [0, 1): a degree-6 polynomial, highest coefficient first (relative error ~2e-7).
constexpr float kExp2Poly[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                               5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

// exp for x <= 0 in a form the compiler vectorizes: 2^(x log2 e) split into exponent bits and kExp2Poly.
#pragma omp declare simd
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504088896341f;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = kExp2Poly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Poly[i];
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Query vectors q0..q0 + n - 1 start with no keys seen (running max -inf, denominator 0); returns the keys
// any of them sees, [min qlo, max qpos].
inline std::pair<int64_t, int64_t> start_rows(const int64_t* qpos, const int64_t* qlo, int64_t q0, int64_t n, float* m,
                                              float* l) {
  int64_t lo = qlo[q0], hi = qpos[q0];
  for (int64_t r = q0; r < q0 + n; ++r) {
    lo = std::min(lo, qlo[r]);
    hi = std::max(hi, qpos[r]);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.f;
  }
  return {lo, hi};
}
