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

// Decode scores of the G query heads of each of nh adjacent KV heads (qf, scaled; query head h * G + g)
// against keys first..last read in place (key t's first head at kp + off(t)), four keys at a time (bf16
// widened in registers):
// scores[(h * G + g) * (last + 1 - first) + key - first]. The nh heads of a key lie side by side, so a
// key's slot is read in one stretch.
template <typename C, typename Off>
void decode_scores(const float* qf, int64_t nh, int64_t G, int64_t D, const C* kp, const Off& off, int64_t first,
                   int64_t last, float* scores, const C* vp = nullptr) {
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
      const float* qh = qf + h * G * D;
      float* sc = scores + h * G * len + (t0 - first);
      int64_t g = 0;
      for (; g + 4 <= G; g += 4) attn_tiles::score_keys<4>(qh + g * D, D, krow, n, sc + g * len, len);
      for (; g + 2 <= G; g += 2) attn_tiles::score_keys<2>(qh + g * D, D, krow, n, sc + g * len, len);
      for (; g < G; ++g) attn_tiles::score_keys<1>(qh + g * D, D, krow, n, sc + g * len, len);
      for (int u = 0; u < 4; ++u) krow[u] += D;
    }
  }
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
