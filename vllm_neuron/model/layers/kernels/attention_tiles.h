// Register-blocked pieces of paged attention's many-row path (prefill, verify), for builds with vector
// intrinsics (simd.h). Included by paged_attention.cpp only under AVX-512 or AVX2 + FMA.
//
// Scoring one query row at a time against a key tile reads the tile from L1 once per row: three loads per
// two multiply-adds, which caps the kernel at a fraction of the FMA peak. Here RB query rows share each
// load: a tile of kTile keys (stored transposed, kt[d][key]) is scored against RB rows with RB x kTile / W
// accumulators in registers, and the probabilities of RB rows multiply a tile of V (vt[key][d]) with
// RB x 4 accumulators per four vectors of the head dim.
#pragma once
#include "simd.h"

namespace attn_tiles {

using vn_simd::Vec;

// Query rows per block: what fits the register file (AVX-512: 32 registers, AVX2: 16).
constexpr int kRows = Vec::W == 16 ? 8 : 2;

// sc[r][j] = q[r] . K[j] for R rows of q (row stride D) and the tile's KT keys.
template <int R, int KT>
inline void score(const float* q, int64_t D, const float* kt, float (*sc)[KT]) {
  constexpr int NV = KT / Vec::W;
  Vec::R acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = Vec::zero();
  for (int64_t i = 0; i < D; ++i) {
    Vec::R k[NV];
    for (int v = 0; v < NV; ++v) k[v] = Vec::load(kt + i * KT + v * Vec::W);
    for (int r = 0; r < R; ++r) {
      const Vec::R x = Vec::set1(q[r * D + i]);
      for (int v = 0; v < NV; ++v) acc[r][v] = Vec::fma(x, k[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) Vec::store(sc[r] + v * Vec::W, acc[r][v]);
}

// a[r][c0 .. c0 + NC * W) += sum over keys j < n of p[r][j] * V[j][same columns], R rows.
template <int R, int NC, int KT>
inline void pv_columns(const float (*p)[KT], int64_t n, const float* vt, int64_t D, int64_t c0, float* a) {
  Vec::R acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = Vec::load(a + r * D + c0 + c * Vec::W);
  for (int64_t j = 0; j < n; ++j) {
    Vec::R v[NC];
    for (int c = 0; c < NC; ++c) v[c] = Vec::load(vt + j * D + c0 + c * Vec::W);
    for (int r = 0; r < R; ++r) {
      const Vec::R x = Vec::set1(p[r][j]);
      for (int c = 0; c < NC; ++c) acc[r][c] = Vec::fma(x, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) Vec::store(a + r * D + c0 + c * Vec::W, acc[r][c]);
}

// a[r] += p[r] . V over the tile's first n keys, for R rows and the whole head dim (a multiple of W).
template <int R, int KT>
inline void pv(const float (*p)[KT], int64_t n, const float* vt, int64_t D, float* a) {
  constexpr int NC = R <= 4 ? 4 : 2;  // R x NC accumulators + NC values within the register file
  int64_t c0 = 0;
  for (; c0 + NC * Vec::W <= D; c0 += NC * Vec::W) pv_columns<R, NC, KT>(p, n, vt, D, c0, a);
  for (; c0 < D; c0 += Vec::W) pv_columns<R, 1, KT>(p, n, vt, D, c0, a);
}

// The first n (1-4) of four scores to sc. Four go out in one store: copying them from a stack buffer (what the
// compiler makes of a loop of n) reloaded a vector store in 8-byte halves, a forwarding stall that took ~15%
// of a cache-resident b16 decode's attention.
inline void store_scores(__m128 s4, int n, float* sc) {
  if (n == 4) {
    _mm_storeu_ps(sc, s4);
    return;
  }
  float s[4];
  _mm_storeu_ps(s, s4);
  for (int u = 0; u < n; ++u) sc[u] = s[u];
}

// Decode scores without transposing the keys: sc[g * len + u] = q[g] . K[u] for the first n of the four
// keys at krow (row pointers into the cache, fp32 or bf16) and GB query heads, one horizontal reduction
// per four keys.
template <int GB, typename E>
inline void score_keys(const float* q, int64_t D, const E* const* krow, int n, float* sc, int64_t len) {
  Vec::R acc[GB][4];
  for (int g = 0; g < GB; ++g)
    for (int u = 0; u < 4; ++u) acc[g][u] = Vec::zero();
  for (int64_t c = 0; c < D; c += Vec::W) {
    Vec::R k[4];
    for (int u = 0; u < 4; ++u) k[u] = Vec::load(krow[u] + c);
    for (int g = 0; g < GB; ++g) {
      const Vec::R x = Vec::load(q + g * D + c);
      for (int u = 0; u < 4; ++u) acc[g][u] = Vec::fma(x, k[u], acc[g][u]);
    }
  }
  for (int g = 0; g < GB; ++g)
    store_scores(Vec::sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), n, sc + g * len);
}

// Vectors of the head dim per decode value block (GB x this many accumulators, GB <= 4).
constexpr int kValueVectors = Vec::W == 16 ? 4 : 2;

// Keys a decode pass asks the cache for ahead of use: a paged cache's rows are strided by the other heads,
// and the hardware prefetcher alone left a b16 decode at a 2,048-token context reading ~7 GB/s. 32 keys
// rather than 16 (Zen 5 EPYC VM, bundled model's attention shapes, 30 layers from memory, medians of four
// alternating runs): batch 1 at 8k 6.5 vs 7.0 ms, batch 16 at 2k 24.1 vs 25.8, at 512 unchanged; 64 was slower.
constexpr int64_t kKeysAhead = 32;

// a[g][c0 .. c0 + NC * W) = sum over keys t < len of p[g * len + t] * V[t][same columns], GB heads; V[t]
// lies at v0 + row(t) (fp32 or bf16 lanes).
template <int GB, int NC, typename E, typename Row>
inline void weigh_values(const float* p, int64_t len, const E* v0, const Row& row, int64_t c0, float* a, int64_t D) {
  Vec::R acc[GB][NC];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = Vec::zero();
  for (int64_t t = 0; t < len; ++t) {
    if (t + kKeysAhead < len) vn_simd::prefetch(v0 + row(t + kKeysAhead) + c0, NC * Vec::W * sizeof(E));
    const E* vs = v0 + row(t) + c0;
    Vec::R v[NC];
    for (int c = 0; c < NC; ++c) v[c] = Vec::load(vs + c * Vec::W);
    for (int g = 0; g < GB; ++g) {
      const Vec::R x = Vec::set1(p[g * len + t]);
      for (int c = 0; c < NC; ++c) acc[g][c] = Vec::fma(x, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c) Vec::store(a + g * D + c0 + c * Vec::W, acc[g][c]);
}

}  // namespace attn_tiles
