// int4 weights against inputs made int16 by VPDPWSSD (AVX512-VNNI): int_dot.h's int4 tile at 16 lanes.
//
// On AVX-512 builds a single input row against int4 weights had only the widening path: every weight
// unpacked to fp32, scaled and offset by two FMAs and multiplied by a third, compute-bound well before the
// weight stream (linear_quant.cpp's kIntDotRows says where this one pays). Here the nibbles are only widened
// to int16 (a superblock's 32 bytes to 32 lanes, masked for its first group, shifted for its second) and each
// group's 32 products are summed in 16 int32 lanes by one VPDPWSSD; the fp32 work is one conversion and one
// FMA per group and row. The inputs are made
// int16 as int_dot.h does (per block of 256 inputs one power of two; bf16 inputs within 2^7 of their block's
// largest exact, the rest rounded to 2^-15 of it), and the group minimum's term takes each group's exact fp32
// sum of the inputs, so the results are int_dot_avx2.h's.
// Layout: int_dot.h's tile_int4.
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

// int4 at 16 lanes (int_dot.h's tile_int4 is the loop): one VPDPWSSD per group of 32 products.
struct Int4Vnni512 {
  using F = __m512;
  struct X {
    __m512i lo, hi;  // inputs of the superblock's first group, then its second
  };
  using W = X;       // the weights alike: a row's 32 bytes widened, low nibbles, then high ones
  static F zero() { return _mm512_setzero_ps(); }
  static X inputs(const int16_t* x) { return {_mm512_loadu_si512(x), _mm512_loadu_si512(x + 32)}; }
  static W weights(const uint8_t* p) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_and_si512(v, _mm512_set1_epi16(15)), _mm512_srli_epi16(v, 4)};
  }
  static void groups(const W& w, const X& x, F& g0, F& g1) {
    g0 = _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), w.lo, x.lo));
    g1 = _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(_mm512_setzero_si512(), w.hi, x.hi));
  }
  static F fma(F g, float s, F acc) { return _mm512_fmadd_ps(g, _mm512_set1_ps(s), acc); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
};

}  // namespace vn_idot
