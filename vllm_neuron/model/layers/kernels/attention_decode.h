// The decode path of paged attention (one query row per item): keys and values read in place, bf16 widened
// in registers. Included by paged_attention.cpp under AVX-512 or AVX2 + FMA, after attention_tiles.h.
#pragma once
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attention_tiles.h"

namespace attn_decode {

// Cache element types the decode path reads in place (widened in registers); others take the copying path.
template <typename C>
constexpr bool kReadInPlace = std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16>;

inline const uint16_t* lanes(const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); }
inline const float* lanes(const float* p) { return p; }

#if defined(__AVX512BF16__)
// Decode scores against a bf16 cache by VDPBF16PS: sc[g * len + u] = q[g] . K[u] for the first n of the four
// keys at krow and GB query heads, q rounded to bf16 once (as the many-row bf16 path does); the products are
// exact and summed in fp32. Half the multiply-adds of widening each key to fp32, and no widening.
template <int GB>
[[gnu::always_inline]] inline void score_keys_bf16(const uint16_t* q, int64_t D, const uint16_t* const* krow,
                                                   int n, float* sc, int64_t len) {
  __m512 acc[GB][4];
  for (int g = 0; g < GB; ++g)
    for (int u = 0; u < 4; ++u) acc[g][u] = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 32) {
    __m512bh k[4];
    for (int u = 0; u < 4; ++u) k[u] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(krow[u] + c));
    for (int g = 0; g < GB; ++g) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(q + g * D + c));
      for (int u = 0; u < 4; ++u) acc[g][u] = _mm512_dpbf16_ps(acc[g][u], x, k[u]);
    }
  }
  for (int g = 0; g < GB; ++g)
    attn_tiles::store_scores(vn_simd::Vec::sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), n, sc + g * len);
}

// Query heads rounded to bf16 for score_keys_bf16, at most this many elements (nh * G * D) per item.
constexpr int64_t kBf16QueryElems = 2048;
#endif

// G query heads' scores against four keys, up to four heads per pass.
template <typename Q, typename E>
[[gnu::always_inline]] inline void score_heads(const Q* qh, int64_t G, int64_t D, const E* const* krow, int n,
                                               float* sc, int64_t len) {
  int64_t g = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Q, uint16_t>) {
    for (; g + 4 <= G; g += 4) score_keys_bf16<4>(qh + g * D, D, krow, n, sc + g * len, len);
    switch (G - g) {  // three heads in one pass (the bundled model's grouping): each key loaded once
      case 3: score_keys_bf16<3>(qh + g * D, D, krow, n, sc + g * len, len); break;
      case 2: score_keys_bf16<2>(qh + g * D, D, krow, n, sc + g * len, len); break;
      case 1: score_keys_bf16<1>(qh + g * D, D, krow, n, sc + g * len, len); break;
      default: break;
    }
    return;
  }
#endif
  if constexpr (std::is_same_v<Q, float>) {
    for (; g + 4 <= G; g += 4) attn_tiles::score_keys<4>(qh + g * D, D, krow, n, sc + g * len, len);
    for (; g + 2 <= G; g += 2) attn_tiles::score_keys<2>(qh + g * D, D, krow, n, sc + g * len, len);
    for (; g < G; ++g) attn_tiles::score_keys<1>(qh + g * D, D, krow, n, sc + g * len, len);
  }
}

// Decode scores of the G query heads of each of nh adjacent KV heads (q, scaled; query head h * G + g)
// against keys first..last read in place (key t's first head at kp + off(t)), four keys at a time:
// scores[(h * G + g) * (last + 1 - first) + key - first]. The nh heads of a key lie side by side, so a
// key's slot is read in one stretch. q is fp32 (keys widened in registers) or, for a bf16 cache on
// AVX512-BF16, bf16 (score_keys_bf16).
template <typename Q, typename C, typename Off>
void decode_scores_with(const Q* qf, int64_t nh, int64_t G, int64_t D, const C* kp, const Off& off, int64_t first,
                        int64_t last, float* scores, const C* vp) {
  const int64_t len = last + 1 - first;
  for (int64_t t0 = first; t0 <= last; t0 += 4) {
    const int n = static_cast<int>(std::min<int64_t>(4, last + 1 - t0));
    for (int64_t t = t0 + attn_tiles::kKeysAhead; t < t0 + attn_tiles::kKeysAhead + 4 && t <= last; ++t) {
      vn_simd::prefetch(kp + off(t), nh * D * sizeof(C));
      if (vp) vn_simd::prefetch(vp + off(t), nh * D * sizeof(C));
    }
    decltype(lanes(kp)) krow[4];
    for (int u = 0; u < 4; ++u) {
      const int64_t t = t0 + std::min(u, n - 1);  // past the last key: read it again, drop the result
      krow[u] = lanes(kp + off(t));
    }
    for (int64_t h = 0; h < nh; ++h) {
      score_heads(qf + h * G * D, G, D, krow, n, scores + h * G * len + (t0 - first), len);
      for (int u = 0; u < 4; ++u) krow[u] += D;
    }
  }
}

template <typename C, typename Off>
void decode_scores(const float* qf, int64_t nh, int64_t G, int64_t D, const C* kp, const Off& off, int64_t first,
                   int64_t last, float* scores, const C* vp = nullptr) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<C, c10::BFloat16>) {
    if (D % 32 == 0 && nh * G * D <= kBf16QueryElems) {
      alignas(64) uint16_t qb[kBf16QueryElems];
      for (int64_t i = 0; i < nh * G * D; ++i) qb[i] = c10::BFloat16(qf[i]).x;
      return decode_scores_with(static_cast<const uint16_t*>(qb), nh, G, D, kp, off, first, last, scores, vp);
    }
  }
#endif
  decode_scores_with(qf, nh, G, D, kp, off, first, last, scores, vp);
}

// acc[g] = sum over keys of p[g * len + key - first] * V[key] for G query heads, V read in place, up to four
// heads and NC vectors of the head dim per register block.
template <int NC, typename E, typename Row>
void weigh_heads(int64_t gb, const float* p, int64_t len, const E* v0, const Row& row, int64_t c0, float* a,
                 int64_t D) {
  switch (gb) {
    case 4: attn_tiles::weigh_values<4, NC>(p, len, v0, row, c0, a, D); break;
    case 3: attn_tiles::weigh_values<3, NC>(p, len, v0, row, c0, a, D); break;
    case 2: attn_tiles::weigh_values<2, NC>(p, len, v0, row, c0, a, D); break;
    default: attn_tiles::weigh_values<1, NC>(p, len, v0, row, c0, a, D); break;
  }
}

// The decode values pass of G query heads (probabilities p [G][len] of keys first..), V of key t at vp + off(t).
template <typename C, typename Off>
void decode_values(const float* p, int64_t G, int64_t len, int64_t first, const C* vp, const Off& off, int64_t D,
                   float* acc) {
  constexpr int NC = attn_tiles::kValueVectors;
  constexpr int64_t W = vn_simd::Vec::W;
  const auto* v0 = lanes(vp);
  const auto row = [&](int64_t t) { return off(t + first); };
  for (int64_t g = 0; g < G; g += 4) {
    const int64_t gb = std::min<int64_t>(4, G - g);
    int64_t c0 = 0;
    for (; c0 + NC * W <= D; c0 += NC * W) weigh_heads<NC>(gb, p + g * len, len, v0, row, c0, acc + g * D, D);
    for (; c0 < D; c0 += W) weigh_heads<1>(gb, p + g * len, len, v0, row, c0, acc + g * D, D);
  }
}

}  // namespace attn_decode
