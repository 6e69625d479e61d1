// int4 weights against inputs made int16 by VPDPWSSD (AVX512-VNNI): int_dot_avx2.h's int4 tile at 16 lanes.
//
// On AVX-512 builds a single input row against int4 weights had only the widening path: every weight
// unpacked to fp32, scaled and offset by two FMAs and multiplied by a third, compute-bound well before the
// weight stream (linear_quant.cpp's kIntDotRows says where this one pays). Here the nibbles are only widened to int16 (a superblock's 32 bytes to 32 lanes,
// masked for its first group, shifted for its second) and each group's 32 products are summed in 16 int32
// lanes by one VPDPWSSD; the fp32 work is one conversion and one FMA per group and row. The inputs are made
// int16 as int_dot.h does (per block of 256 inputs one power of two; bf16 inputs within 2^7 of their block's
// largest exact, the rest rounded to 2^-15 of it), and the group minimum's term takes each group's exact fp32
// sum of the inputs, so the results are int_dot_avx2.h's.
//
// Layout (quant_bands.py): per band, [K / 64][rows][32 bytes] (byte j: weight j's code in its low nibble,
// weight j + 32's in its high one), scales [K / 64][rows][scale, min, scale, min].
// Where it pays (linear_quant.cpp's kIntDotRows): one decode step's 120 int4 layer linears of the bundled model
// against the widening path, 2 threads, in one process, alternating (2-core Zen 4 EPYC VM, 2026-12-06, two runs):
// 1 row 3.04 / 3.01 vs 3.60 / 3.57 ms, but 2 rows 4.64 / 4.59 vs 4.41 / 4.35 and 4 rows 8.46 / 8.40 vs 7.44 / 7.19:
// from two rows on the widening shared by the rows saves more than the integer products do (on AVX2 from four).
// The int4 model's decode_b1 step: 6.35 -> 5.35 ms (benchmarks/ab_steps.py, 3 rounds).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "int_dot.h"
#include "simd.h"

namespace vn_idot {

// The NB (1..4) rows of the int4 band at `band` (scales at `sm`) against input rows 0 .. MB - 1 (xq rows of
// stride K, d of stride blocks(K), xsum of stride K / 32): out[i * NB + j] = row i . band row j. pf: the band to
// prefetch meanwhile, or null.
template <int MB, int NB>
inline void tile_int4_512(const uint8_t* band, const float* sm, const int16_t* xq, const float* d,
                          const float* xsum, int64_t K, float* out, const uint8_t* pf) {
  const int64_t nb = blocks(K), sbs = kBlock / 64;
  const __m512i low = _mm512_set1_epi16(15);
  __m512 acc[MB][NB];
  float mins[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      acc[i][j] = _mm512_setzero_ps();
      mins[i][j] = 0.f;
    }
  for (int64_t b = 0; b < nb; ++b) {
    float f[MB];
    for (int i = 0; i < MB; ++i) f[i] = d[i * nb + b];
    const int64_t sb1 = std::min(K / 64, (b + 1) * sbs);
    for (int64_t sb = b * sbs; sb < sb1; ++sb) {
      const uint8_t* p = band + sb * NB * 32;
      const float* s = sm + sb * NB * 4;
      if (pf)
        for (int l = 0; l < NB * 32; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(pf + sb * NB * 32 + l), _MM_HINT_T1);
      __m512i x0[MB], x1[MB];  // inputs of the superblock's first group, then its second
      for (int i = 0; i < MB; ++i) {
        x0[i] = _mm512_loadu_si512(xq + i * K + sb * 64);
        x1[i] = _mm512_loadu_si512(xq + i * K + sb * 64 + 32);
      }
      for (int j = 0; j < NB; ++j) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j)));
        const __m512i w0 = _mm512_and_si512(v, low), w1 = _mm512_srli_epi16(v, 4);
        for (int i = 0; i < MB; ++i) {
          const __m512i g0 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w0, x0[i]);
          const __m512i g1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w1, x1[i]);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(g0), _mm512_set1_ps(s[4 * j] * f[i]), acc[i][j]);
          acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(g1), _mm512_set1_ps(s[4 * j + 2] * f[i]), acc[i][j]);
          const float* si = xsum + i * (K / kGroup) + 2 * sb;
          mins[i][j] += s[4 * j + 1] * si[0] + s[4 * j + 3] * si[1];
        }
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i * NB + j] = _mm512_reduce_add_ps(acc[i][j]) + mins[i][j];
}

}  // namespace vn_idot
