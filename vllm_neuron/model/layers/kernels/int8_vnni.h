// int8 weights against bf16 inputs by VPDPWSSD (AVX512-VNNI): integer products, integer sums.
//
// Widening every int8 weight to fp32 (a sign extension and a conversion per 16 weights, then an FMA) made
// the int8 kernel compute-bound at one row: it read its bytes at ~20 GB/s where the bf16 kernel streams
// at ~27-50. Here a weight is only sign-extended to int16 (32 per instruction) and VPDPWSSD multiplies
// 32 of them by 32 int16 inputs and sums the pairs into int32 lanes, a third of the instructions.
//
// The inputs become int16 exactly, or nearly: per row and block of kBlock inputs one power of two puts the
// block's largest magnitude just under 2^15, and a bf16 value carries 8 significant bits, so every input
// within 2^7 of the block's largest is an exact integer; smaller ones are rounded to a step of at most
// 2^-14 of the largest (a 128th of the largest one's own bf16 rounding step). The int32 sums of a block are
// exact (2 * kBlock / 16 products of < 2^7 * 2^15 per lane: < 2^27), then scaled into the fp32 sums.
//
// Layout: the band order of quant_bands.py ([K / 16][4 rows][16] int8 per band of four output rows), so one
// 32-byte load holds 16 weights of two rows; each 16-input chunk is stored twice in a 32-lane vector, and
// the lanes' sums fall into rows by vector half (lanes 0-7: the first row, 8-15: the second).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"

namespace vn_vnni {

constexpr int64_t kBlock = 256;  // inputs per int16 scale

inline int64_t blocks(int64_t K) { return (K + kBlock - 1) / kBlock; }

// Rows [M, K] of bf16 bits -> xq [M][K / 16][32] int16 (each chunk twice) and xs [M][blocks(K)], the fp32
// factor back from each block's integers. K is a multiple of 16.
inline void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int16_t* xq, float* xs) {
  const int64_t nb = blocks(K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k0 = b * kBlock, k1 = std::min(K, k0 + kBlock);
      const uint16_t* xr = x + m * K;
      const auto widen = [&](int64_t k) {
        const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + k));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      };
      __m512 mx = _mm512_setzero_ps();
      for (int64_t k = k0; k < k1; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(widen(k)));
      const float amax = _mm512_reduce_max_ps(mx);
      int e = 0;
      std::frexp(amax, &e);  // amax < 2^e
      // Below 2^-100 (or all zeros) the block adds nothing an fp32 output can hold: zeros, factor 0.
      const bool zero = e < -100 || !(amax > 0.f);
      const __m512 up = _mm512_set1_ps(zero ? 0.f : std::ldexp(1.f, 15 - e));
      xs[m * nb + b] = zero ? 0.f : std::ldexp(1.f, e - 15);
      for (int64_t k = k0; k < k1; k += 16) {
        const __m256i v = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(widen(k), up)));
        int16_t* dst = xq + (m * (K / 16) + k / 16) * 32;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), v);
      }
    }
}

// [sum of a's lower half, a's upper half, b's lower half, b's upper half].
inline __m128 half_sums(__m512 a, __m512 b) {
  const auto upper = [](__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); };
  return vn_simd::sum4_256(_mm512_castps512_ps256(a), upper(a), _mm512_castps512_ps256(b), upper(b));
}

// The four rows of the band at `band` (int8, band order) against input rows 0 .. MB - 1: out[i][j] is row
// i's dot product with band row j, times scale[j].
template <int MB>
inline void tile(const int8_t* band, const float* scale, const int16_t* xq, const float* xs, int64_t K,
                 float* out, const int8_t* pf = nullptr) {
  // One or two input rows leave too few independent sums to hide VPDPWSSD's latency: chunks alternate
  // between two sets of them there.
  constexpr int S = MB <= 2 ? 2 : 1;
  const int64_t nb = blocks(K), chunks = K / 16;
  __m512 accf[MB][2];
  for (int i = 0; i < MB; ++i) accf[i][0] = accf[i][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i acc[S][MB][2];
    for (int s = 0; s < S; ++s)
      for (int i = 0; i < MB; ++i) acc[s][i][0] = acc[s][i][1] = _mm512_setzero_si512();
    const auto step = [&](int s, int64_t c) {
      const int8_t* p = band + c * 64;
      // Into L2 only (simd.h says why): one decode step's int8 linears, Zen 5 EPYC, 2 threads, alternating in
      // one process, two runs: 5.46-5.72 -> 4.84-5.08 ms at 1 row (L1 before), 6.99-9.86 -> 6.82-9.19 at 4.
      if (pf) vn_simd::prefetch(pf + c * 64, 64);
      const __m512i w01 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      const __m512i w23 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
      for (int i = 0; i < MB; ++i) {
        const __m512i xv = _mm512_loadu_si512(xq + (i * chunks + c) * 32);
        acc[s][i][0] = _mm512_dpwssd_epi32(acc[s][i][0], w01, xv);
        acc[s][i][1] = _mm512_dpwssd_epi32(acc[s][i][1], w23, xv);
      }
    };
    const int64_t c1 = std::min(chunks, (b + 1) * (kBlock / 16));
    int64_t c = b * (kBlock / 16);
    for (; c + S <= c1; c += S)
      for (int s = 0; s < S; ++s) step(s, c + s);
    for (; c < c1; ++c) step(0, c);
    for (int i = 0; i < MB; ++i) {
      const __m512 f = _mm512_set1_ps(xs[i * nb + b]);
      for (int h = 0; h < 2; ++h) {
        __m512i sum = acc[0][i][h];
        for (int s = 1; s < S; ++s) sum = _mm512_add_epi32(sum, acc[s][i][h]);
        accf[i][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), f, accf[i][h]);
      }
    }
  }
  const __m128 sc = _mm_loadu_ps(scale);
  for (int i = 0; i < MB; ++i) _mm_storeu_ps(out + 4 * i, _mm_mul_ps(half_sums(accf[i][0], accf[i][1]), sc));
}

}  // namespace vn_vnni
