// Keys read through a sequence's block table in tiles of kTile, widened to fp32 (paged_attention.cpp): the
// helpers of its scalar paths, and, where the build has vector intrinsics (VN_ATTENTION_TILES), the many-row item
// that widens its keys once and runs attention_tiles.h's register blocks over them.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cache_elems.h"
#include "online_softmax.h"

namespace {

constexpr int64_t kTile = 32;

// The cache slot of a sequence's key t, through its block table.
inline int64_t slot_of(const int64_t* table, int64_t block_size, int64_t t) {
  return table[t / block_size] * block_size + t % block_size;
}

// kt[i][j] = K[t0 + j][i] for the tile's n keys (zeros past n), so scores run across keys.
template <typename T>
inline void load_k_tile(const T* kp, const int64_t* table, int64_t block_size, int64_t slot_stride,
                        int64_t head_off, int64_t D, int64_t t0, int64_t n, float* kt) {
  for (int64_t j = 0; j < n; ++j) {
    const T* ks = kp + slot_of(table, block_size, t0 + j) * slot_stride + head_off;
    for (int64_t i = 0; i < D; ++i) kt[i * kTile + j] = to_f(ks[i]);
  }
  for (int64_t j = n; j < kTile; ++j)
    for (int64_t i = 0; i < D; ++i) kt[i * kTile + j] = 0.f;
}

// vt[j][i] = V[t0 + j][i] for the tile's n keys, zeros past n (their probabilities are 0, and 0 times
// whatever the buffer held could be NaN).
template <typename T>
inline void load_v_tile(const T* vp, const int64_t* table, int64_t block_size, int64_t slot_stride,
                        int64_t head_off, int64_t D, int64_t t0, int64_t n, float* vt) {
  for (int64_t j = 0; j < n; ++j) {
    const T* vs = vp + slot_of(table, block_size, t0 + j) * slot_stride + head_off;
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) vt[j * D + i] = to_f(vs[i]);
  }
  std::fill(vt + n * D, vt + kTile * D, 0.f);
}

inline void score_tile(const float* qv, const float* kt, int64_t D, float* sc) {
  for (int64_t i = 0; i < D; ++i) {
    const float x = qv[i];
    const float* row = kt + i * kTile;
#pragma omp simd
    for (int64_t j = 0; j < kTile; ++j) sc[j] += x * row[j];
  }
}

#ifdef VN_ATTENTION_TILES
// R query rows q0.. of an item over the key tiles their positions reach, online softmax; kt / vt hold the
// item's keys from `first` on, widened (zero past the last key).
template <int R>
void tiled_rows(const float* qf, int64_t q0, const int64_t* qpos, const int64_t* qlo, int64_t first, const float* kt,
                const float* vt, int64_t D, float* m, float* l, float* acc) {
  const auto [lo, hi] = start_rows(qpos, qlo, q0, R, m, l);
  std::fill(acc + q0 * D, acc + (q0 + R) * D, 0.f);
  float sc[R][kTile], p[R][kTile];
  for (int64_t t = (lo - first) / kTile; t <= (hi - first) / kTile; ++t) {
    const int64_t t0 = first + t * kTile;
    attn_tiles::score<R, kTile>(qf + q0 * D, D, kt + t * D * kTile, sc);
    int64_t used = 0;  // keys of the tile any row sees
    for (int r = 0; r < R; ++r) {
      const int64_t qi = q0 + r;
      const int64_t visible = std::min<int64_t>(kTile, qpos[qi] - t0 + 1);  // causal: keys <= position
      const int64_t j0 = std::max<int64_t>(0, qlo[qi] - t0);               // the window: keys >= its first
      if (visible <= j0) {
        std::fill(p[r], p[r] + kTile, 0.f);
        continue;
      }
      float mx = m[qi];
#pragma omp simd reduction(max : mx)
      for (int64_t j = 0; j < kTile; ++j) {
        const float v = (j >= j0 && j < visible) ? sc[r][j] : -std::numeric_limits<float>::infinity();
        mx = v > mx ? v : mx;
      }
      const float corr = exp_nonpositive(m[qi] - mx);  // exp(-inf) -> 0 on the first tile
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < kTile; ++j) {
        const float e = (j >= j0 && j < visible) ? exp_nonpositive(sc[r][j] - mx) : 0.f;
        p[r][j] = e;
        sum += e;
      }
      l[qi] = l[qi] * corr + sum;
      m[qi] = mx;
      float* a = acc + qi * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) a[i] *= corr;
      used = std::max(used, visible);
    }
    attn_tiles::pv<R, kTile>(p, used, vt + t * kTile * D, D, acc + q0 * D);
  }
}

// Many query rows of one item: keys first..last widened to fp32 once (K transposed per tile, V row-major),
// then kRows query rows at a time.
template <typename C>
void tiled_item(const float* qf, int64_t nq, const int64_t* qpos, const int64_t* qlo, int64_t first, int64_t last,
                const C* kp, const C* vp, const int64_t* table, int64_t block_size, int64_t slot_stride,
                int64_t head_off, int64_t D, std::vector<float>& kt, std::vector<float>& vt, float* m, float* l,
                float* acc) {
  const int64_t ntiles = (last + 1 - first + kTile - 1) / kTile;
  kt.resize(ntiles * D * kTile);
  vt.resize(ntiles * kTile * D);
  for (int64_t t = 0; t < ntiles; ++t) {
    const int64_t t0 = first + t * kTile, n = std::min<int64_t>(kTile, last + 1 - t0);
    for (int64_t u = t0 + kTile; u < t0 + 2 * kTile && u <= last; ++u) {  // the next tile, from memory meanwhile
      const int64_t off = slot_of(table, block_size, u) * slot_stride + head_off;
      vn_simd::prefetch(kp + off, D * sizeof(C));
      vn_simd::prefetch(vp + off, D * sizeof(C));
    }
    load_k_tile(kp, table, block_size, slot_stride, head_off, D, t0, n, kt.data() + t * D * kTile);
    load_v_tile(vp, table, block_size, slot_stride, head_off, D, t0, n, vt.data() + t * kTile * D);
  }
  constexpr int RB = attn_tiles::kRows;
  int64_t q0 = 0;
  for (; q0 + RB <= nq; q0 += RB) tiled_rows<RB>(qf, q0, qpos, qlo, first, kt.data(), vt.data(), D, m, l, acc);
  // The rest in blocks of 4, 2, 1: each row scored alone would read the widened keys once per row.
  if (RB > 4 && q0 + 4 <= nq) {
    tiled_rows<4>(qf, q0, qpos, qlo, first, kt.data(), vt.data(), D, m, l, acc);
    q0 += 4;
  }
  if (RB > 2 && q0 + 2 <= nq) {
    tiled_rows<2>(qf, q0, qpos, qlo, first, kt.data(), vt.data(), D, m, l, acc);
    q0 += 2;
  }
  for (; q0 < nq; ++q0) tiled_rows<1>(qf, q0, qpos, qlo, first, kt.data(), vt.data(), D, m, l, acc);
}
#endif

}  // namespace
