// int8 and int4 weights against activations made int16, by integer dot products (AVX2 without AVX-512).
//
// On AVX2 the widening path (linear_quant.cpp) turns every weight into fp32 and FMAs it: 8 products per
// instruction plus the widening's conversions, compute-bound well before the weight stream is. Here a weight
// is only widened to int16 (int8 sign-extended, int4 nibbles masked out of the widened bytes, 16 per
// instruction) and VPMADDWD multiplies 16 of them by 16 int16 inputs and adds the pairs into 8 int32 lanes;
// the fp32 work is left to once per int4 group or per block of inputs. This is int8_vnni.h's design with
// AVX2's 8-lane VPMADDWD in place of VPDPWSSD.
//
// Why int16 and not int8 inputs (llama.cpp's Q8 blocks, VPMADDUBSW): int8 inputs were tried first (a step of a
// 127th of each 32-input block's largest) and changed greedy tokens of the fp32 int8 parity test
// (tests/parity/test_weight_quant_parity.py, 6th token of the first prompt); int16 inputs carry 2^8 times
// less rounding, and per row cost about the same here: VPMADDUBSW's 32 products need the sign trick and a
// VPMADDWD by ones after them (three instructions), VPMADDWD's 16 need one, and an int4 group's fp32 scaling
// costs the same either way.
//
// Numerics. Per input row and block of kBlock inputs one power of two puts the block's largest magnitude just
// under 2^15 (one power more when it would round to 2^15), so every input is rounded to a step of at most
// 2^-15 of its block's largest magnitude (error <= half a step). A bf16 input carries 8 significant bits,
// so bf16 inputs within 2^7 of their block's largest are exact, as in int8_vnni.h (the same blocks and steps:
// bf16 rows get that header's results on AVX-512-VNNI CPUs and this one's on AVX2 alike). The int32 sums are
// exact (a lane adds kBlock / 8 products of < 2^7 * 2^15: < 2^27), then scaled into fp32 sums once per block
// (int8) or per group of 32 (int4, its scale; the block's factor once per block). The int4 minimum's term,
// min * sum(x), takes each group's exact fp32 sum of x, so only the products with the codes carry the rounding.
// An output is off from the dequantized matmul by at most sum over inputs of step / 2 * |w| (for int4, |q *
// scale|), plus the fp32 sums' own rounding. A NaN in a block makes its factor NaN, so its row's outputs are NaN
// (as the fp32 products would be); so does an infinite input.
//
// Layouts are the band order of quant_bands.py, read as stored (no repack):
//   int8: [K / 16][rows][16] per band: 16 weights of one row per load, 8 int32 lanes per row.
//   int4: [K / 64][rows][32 bytes] per band (byte j: weight j low nibble, j + 32 high), scales [K / 64][rows]
//         (scale, min, scale, min): bytes 0-15 widen to weights 0-15 and 32-47, bytes 16-31 to 16-31 and 48-63.
// Where it pays (linear_quant.cpp's kIntDotRows), measured against the widening path on a Zen 5 EPYC with the
// avx2 build forced, 1 thread, alternating in one process (a shared, loaded machine), one decode step's linears
// of the bundled model with every call's weights read from memory (a 256 MB read before each, as a step streams
// weights that do not fit the caches), ms: int8 1 row 6.9 vs 7.7, 2: 7.5 vs 8.1, 4: 12.4 vs 16.5, 8: 22.9 vs 35.0,
// 16: 46.7 vs 62.6; int4 1 row 7.0 vs 9.6, 2: 10.1 vs 12.0, 4: 15.1 vs 16.7, 8: 27.4 vs 31.5, 16: 53.0 vs 60.5.
// With the weights hot in L2 (one shape called in a loop) int8 still won everywhere (0.56-0.91) and int4 from 1
// to 3 rows (0.51-0.95), 4 to 16 rows were level (0.92-1.12): an int4 group's per-row scaling (convert, scale,
// FMA per 32 weights) then costs what the widening shared by the rows saves.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "int_dot.h"
#include "simd.h"

namespace vn_idot {

using vn_simd::Vec;  // the 8-lane one: this header is for AVX2 builds without AVX-512

// out[i * NB + j] = the sum of acc[i][j]'s lanes, times mul[j] if given.
template <int MB, int NB>
inline void store_sums(__m256 (&acc)[MB][NB], float* out, const float* mul) {
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i * NB + j] = Vec::sum(acc[i][j]) * (mul ? mul[j] : 1.f);
}

// The NB (1..4) rows of the int8 band at `band` against input rows 0 .. MB - 1 (xq rows of stride K, d of stride
// blocks(K)): out[i * NB + j] = row i . band row j, times scale[j]. pf: the band to prefetch meanwhile, or null.
template <int MB, int NB>
inline void tile_int8(const int8_t* band, const float* scale, const int16_t* xq, const float* d, int64_t K,
                      float* out, const int8_t* pf) {
  const int64_t chunks = K / 16, nb = blocks(K);
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i s[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) s[i][j] = _mm256_setzero_si256();
    const int64_t c1 = std::min(chunks, (b + 1) * (kBlock / 16));
    for (int64_t c = b * (kBlock / 16); c < c1; ++c) {
      const int8_t* p = band + c * 16 * NB;
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + c * 16 * NB), _MM_HINT_T1);
      __m256i w[NB];
      for (int j = 0; j < NB; ++j)
        w[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * j)));
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + c * 16));
        for (int j = 0; j < NB; ++j) s[i][j] = _mm256_add_epi32(s[i][j], _mm256_madd_epi16(w[j], xv));
      }
    }
    for (int i = 0; i < MB; ++i) {
      const __m256 f = _mm256_broadcast_ss(d + i * nb + b);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i][j]), f, acc[i][j]);
    }
  }
  store_sums(acc, out, scale);
}

// int4 at 8 lanes (int_dot.h's tile_int4 is the loop): VPMADDWD's pairs, two per group of 32 products.
struct Int4Avx2 {
  using F = __m256;
  using X = const int16_t*;  // read where used: four rows' 16 registers of inputs would not stay in AVX2's 16
  struct W {
    __m256i w[4];  // weights 0-15, 16-31 (the first group), 32-47, 48-63 (the second)
  };
  static F zero() { return _mm256_setzero_ps(); }
  static X inputs(const int16_t* x) { return x; }
  static W weights(const uint8_t* p) {
    const __m256i low = _mm256_set1_epi16(15);
    W r;
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)));
      r.w[h] = _mm256_and_si256(v, low);
      r.w[2 + h] = _mm256_srli_epi16(v, 4);
    }
    return r;
  }
  static void groups(const W& w, X xr, F& g0, F& g1) {
    const auto x = [&](int q) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16 * q)); };
    g0 = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w.w[0], x(0)), _mm256_madd_epi16(w.w[1], x(1))));
    g1 = _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w.w[2], x(2)), _mm256_madd_epi16(w.w[3], x(3))));
  }
  static F fma(F g, float s, F acc) { return _mm256_fmadd_ps(g, _mm256_set1_ps(s), acc); }
  static float sum(F v) { return Vec::sum(v); }
};

}  // namespace vn_idot
