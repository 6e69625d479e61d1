// fp32 vectors of the build's width for the linear kernels: 16 lanes where the compiler targets AVX-512,
// 8 on AVX2 + FMA. Included only under one of those two.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace vn_simd {

// The sums of four 8-lane vectors at once (a third of four separate reductions' shuffles).
inline __m128 sum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));  // a b a b per lane
  const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// The largest lane and the sum of an 8-lane vector (the AVX2 Vec's reductions; also for 8-lane work in AVX-512
// builds).
inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

#if defined(__AVX512F__)
struct Vec {
  using R = __m512;
  static constexpr int W = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static R load(const uint16_t* p) {  // W bf16 -> fp32 (bf16 is the upper half of an fp32)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static R set1(float v) { return _mm512_set1_ps(v); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static float sum(R v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(R v) { return _mm512_reduce_max_ps(v); }
  static uint32_t nan_lanes(R v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); }  // bit i: lane i is NaN
  static uint32_t eq_lanes(R a, R b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  // The sums of four vectors at once (a third of four separate reductions' shuffles).
  static __m128 sum4(R a, R b, R c, R d) {
    const R ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a b a b per 128-bit lane
    const R cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const R s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));  // a b c d
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  }
  static R i8(const int8_t* p) {  // W int8 -> fp32
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void u4(const uint8_t* p, R& lo, R& hi) {  // W bytes -> their low and high nibbles as fp32
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
};
#else
struct Vec {
  using R = __m256;
  static constexpr int W = 8;
  static R zero() { return _mm256_setzero_ps(); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static R set1(float v) { return _mm256_set1_ps(v); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static float reduce_max(R v) { return max8(v); }
  static uint32_t nan_lanes(R v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)); }
  static uint32_t eq_lanes(R a, R b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
  static float sum(R v) { return sum8(v); }
  static __m128 sum4(R a, R b, R c, R d) { return sum4_256(a, b, c, d); }
  static R i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void u4(const uint8_t* p, R& lo, R& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
};
#endif

// Asks for the cache lines of [p, p + bytes) ahead of use (a hint: never faults, whatever p is), into L2
// only (PREFETCHT1): pulled into L1 too they evicted lines still being read and held its few miss buffers.
// Zen 5 EPYC, 2 threads, alternating in one process: 30 layers of b16 decode attention over 400-token
// contexts from memory 10.4 -> 7.2 ms (b1 over 2,048: 4.3 -> 2.9); one decode step's bf16 linears by the
// weight-streaming kernel 10.0 -> 9.0 ms at 1 row, 15.2 -> 8.8 at 4; fp32 22.1 -> 20.4 and 21.9 -> 16.1;
// prefill attention and 16 fp32 rows level. The avx2 build forced on the same CPU: attention 15.1 -> 9.5,
// fp32 linears 22.1 -> 20.0 (1 row), 28.1 -> 22.8 (4), bf16 ones 4-8% slower (fp32 is that class's dtype).
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(static_cast<const char*>(p) + o, _MM_HINT_T1);
}

// Writes the MB x NB dot products acc to y (row stride N) at (m0, n0), each times mul[j] (or 1), as T.
template <int MB, int NB, typename T, typename Put>
inline void store_tile(Vec::R (&acc)[MB][NB], T* y, int64_t N, int64_t m0, int64_t n0, const float* mul, Put put) {
  for (int i = 0; i < MB; ++i) {
    float s[NB];
    if constexpr (NB == 4) {
      _mm_storeu_ps(s, Vec::sum4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
    } else {
      for (int j = 0; j < NB; ++j) s[j] = Vec::sum(acc[i][j]);
    }
    for (int j = 0; j < NB; ++j) put(y + (m0 + i) * N + n0 + j, mul ? s[j] * mul[n0 + j] : s[j]);
  }
}

}  // namespace vn_simd
