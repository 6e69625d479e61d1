// Input rows made int16 for integer dot products against int8 / int4 weights, the int4 tile's loop and the band
// loop those kernels share: the ISA-neutral part of int_dot_avx2.h (the AVX2 build's tiles) and int4_vnni.h
// (AVX512-VNNI's int4 tile). That header's comment states the numerics.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include <ATen/Parallel.h>

#include "simd.h"

namespace vn_idot {

constexpr int64_t kBlock = 256;  // inputs per int16 factor
constexpr int64_t kGroup = 32;   // inputs per exact sum (an int4 group)

inline int64_t blocks(int64_t K) { return (K + kBlock - 1) / kBlock; }

// Rows x [M, K] fp32 (K a multiple of 16) -> xq [M, K] int16, d [M][blocks(K)] (x ~= xq * d) and sum
// [M][K / 32] (K a multiple of 64 only: int4), each group's exact fp32 sum of x.
inline void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* xq, float* d, float* sum) {
  const int64_t nb = blocks(K);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k0 = b * kBlock, k1 = std::min(K, k0 + kBlock);
      __m256 mx = _mm256_setzero_ps();
      int nan = 0;
      for (int64_t k = k0; k < k1; k += 8) {
        const __m256 v = _mm256_loadu_ps(xr + k);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v));
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
      const float amax = vn_simd::max8(mx);
      nan |= !std::isfinite(amax);  // an infinite input: NaN outputs too, as its products with 0 would be
      int e = 0;
      std::frexp(amax, &e);  // amax < 2^e
      if (amax * std::ldexp(1.f, 15 - e) >= 32767.5f) ++e;  // would round to 2^15
      // Below 2^-100 (or all zeros) the block adds nothing an fp32 output can hold: zeros, factor 0.
      const bool zero = e < -100 || !(amax > 0.f);
      const __m256 up = _mm256_set1_ps(zero || nan ? 0.f : std::ldexp(1.f, 15 - e));
      d[m * nb + b] = nan ? NAN : zero ? 0.f : std::ldexp(1.f, e - 15);
      for (int64_t k = k0; k < k1; k += 16) {
        const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k), up));
        const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + k + 8), up));
        // packs works per 128-bit half: [lo 0-3, hi 0-3 | lo 4-7, hi 4-7], put back in order
        const __m256i v = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + k), v);
      }
    }
    if (sum)
      for (int64_t g = 0; g < K / kGroup; ++g) {
        __m256 s = _mm256_setzero_ps();
        for (int i = 0; i < kGroup; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(xr + g * kGroup + i));
        sum[m * (K / kGroup) + g] = vn_simd::sum8(s);
      }
  }
}

// Input rows made int16 (quantize_rows), with each block's factor and each group's exact sum.
struct Rows {
  int64_t M, K, nb;
  std::vector<int16_t> q;
  std::vector<float> d, sum;
  // with_sums: the groups' exact sums too (int4's minimums; K a multiple of 64)
  Rows(const float* x, int64_t M_, int64_t K_, bool with_sums)
      : M(M_), K(K_), nb(blocks(K_)), q(M_ * K_), d(M_ * nb), sum(with_sums ? M_ * (K_ / kGroup) : 0) {
    quantize_rows(x, M, K, q.data(), d.data(), with_sums ? sum.data() : nullptr);
  }
  const int16_t* at(int64_t m) const { return q.data() + m * K; }
  const float* d_at(int64_t m) const { return d.data() + m * nb; }
  const float* sum_at(int64_t m) const { return sum.data() + m * (K / kGroup); }
};

// The NB (1..4) rows of the int4 band at `band` (scales at `sm`) against input rows 0 .. MB - 1 (xq rows of
// stride K, d of stride blocks(K), xsum: the groups' exact sums, stride K / 32): out[i * NB + j] = row i . band
// row j. pf: the band to prefetch meanwhile, or null. The loop is the same at every vector width; V supplies its
// steps (int_dot_avx2.h's Int4Avx2, int4_vnni.h's Int4Vnni512): F, the fp32 vector, zero / fma / sum on it;
// inputs(x): a row's 64 inputs of a superblock (X); weights(p): a row's 32 bytes of codes widened to int16 (W);
// groups(w, x, g0, g1): each of the superblock's two groups' 32 products, summed exactly and made fp32.
// Layout (quant_bands.py): per band, [K / 64][rows][32 bytes] (byte j: weight j's code in its low nibble, weight
// j + 32's in its high one), scales [K / 64][rows][scale, min, scale, min].
template <typename V, int MB, int NB>
inline void tile_int4(const uint8_t* band, const float* sm, const int16_t* xq, const float* d, const float* xsum,
                      int64_t K, float* out, const uint8_t* pf) {
  const int64_t nb = blocks(K), sbs = kBlock / 64;
  typename V::F acc[MB][NB];
  float mins[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      acc[i][j] = V::zero();
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
      typename V::X x[MB];
      for (int i = 0; i < MB; ++i) x[i] = V::inputs(xq + i * K + sb * 64);
      for (int j = 0; j < NB; ++j) {
        const typename V::W w = V::weights(p + 32 * j);
        for (int i = 0; i < MB; ++i) {
          typename V::F g0, g1;
          V::groups(w, x[i], g0, g1);
          acc[i][j] = V::fma(g0, s[4 * j] * f[i], acc[i][j]);
          acc[i][j] = V::fma(g1, s[4 * j + 2] * f[i], acc[i][j]);
          const float* si = xsum + i * (K / kGroup) + 2 * sb;
          mins[i][j] += s[4 * j + 1] * si[0] + s[4 * j + 3] * si[1];
        }
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i * NB + j] = V::sum(acc[i][j]) + mins[i][j];
}

// f(std::integral_constant<int, MB>, m0) over rows 0 .. M - 1 in blocks of four, then the last 1-3.
template <typename F>
inline void row_blocks(int64_t M, F&& f) {
  int64_t m0 = 0;
  for (; M - m0 >= 4; m0 += 4) f(std::integral_constant<int, 4>{}, m0);
  switch (M - m0) {
    case 3: f(std::integral_constant<int, 3>{}, m0); break;
    case 2: f(std::integral_constant<int, 2>{}, m0); break;
    case 1: f(std::integral_constant<int, 1>{}, m0); break;
    default: break;
  }
}

// Every input row against every band of B output rows (the last N % B rows a band of their own), bands in
// contiguous ranges per thread (one sequential weight stream each), four input rows at a time:
// tile(mb, nb, m0, n0, out, pf) computes out[MB * NB] (mb, nb: integral constants), pf the first row of the band
// `ahead` bands on (while the first row block runs, if the thread's range holds it) or -1; put(m, n, v) stores.
template <int B, typename Tile, typename Put>
void run_bands(int64_t M, int64_t N, int64_t ahead, const Tile& tile, const Put& put) {
  const auto band = [&](auto nb, int64_t n0, int64_t nend) {
    constexpr int NB = decltype(nb)::value;
    float out[4 * NB];
    const int64_t pf = n0 + ahead * B;
    row_blocks(M, [&](auto mb, int64_t m0) {
      constexpr int MB = decltype(mb)::value;
      tile(mb, nb, m0, n0, out, m0 == 0 && pf + NB <= nend ? pf : -1);
      for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NB; ++j) put(m0 + i, n0 + j, out[NB * i + j]);
    });
  };
  const int64_t bands = N / B, n_tail = bands * B;
  at::parallel_for(0, bands, 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) band(std::integral_constant<int, B>{}, b * B, b1 * B);
  });
  switch (N - n_tail) {
    case 3: band(std::integral_constant<int, 3>{}, n_tail, N); break;
    case 2: band(std::integral_constant<int, 2>{}, n_tail, N); break;
    case 1: band(std::integral_constant<int, 1>{}, n_tail, N); break;
    default: break;
  }
}

}  // namespace vn_idot
