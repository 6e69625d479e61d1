// int8 and int4 weights against activations made int8, by integer dot products (AVX2 without AVX-512).
//
// On AVX2 the widening path (linear_quant.cpp) turns every weight into fp32 and FMAs it: 8 products per
// instruction plus the widening's conversions, compute-bound well before the weight stream is. Here the
// weights stay 8-bit (int8 as they are, int4 split into nibbles 0..15) and VPMADDUBSW multiplies 32 unsigned
// bytes by 32 signed bytes into 16 int16 pair sums, VPMADDWD by ones adds those pairs into 8 int32 lanes:
// 32 products per two instructions, the fp32 work left to once per block of 32 inputs.
//
// Numerics. Per input row and block of kBlock = 32 inputs (the int4 group), one fp32 factor d = max|x| / 127
// and x ~= d * round(x / d), |round(x / d)| <= 127: every input is rounded to a step of a 127th of its block's
// largest magnitude (error <= d / 2, a 254th of the largest; an input of the block's largest magnitude is
// exact up to that step's own fp32 rounding). The integer sums are exact: a VPMADDUBSW pair is at most
// 2 * 127 * 127 = 32,258 < 2^15 (int8 weights lie in -127..127; int4 codes are <= 15), and a block adds 32
// products of < 2^14 per row. What the block then contributes is that exact sum times d (times the int4
// group's scale), in fp32. The int4 minimum's term, min * sum(x), takes the block's exact fp32 sum of x, so
// only the products with the codes carry the input rounding. An output is therefore off from the dequantized
// matmul by at most sum over blocks of d_b / 2 * sum |w| over the block (the test's bound); in relative terms
// about 2^-8 of each block's largest input, where an int4 weight's own rounding is a 30th of its group's range.
// A NaN anywhere in a block makes its factor NaN (so the row's outputs NaN, as the fp32 products would be);
// an infinite input leaves NaN or infinite outputs as well.
//
// Layouts are the band order of quant_bands.py, read as they are stored (no repack):
//   int8: [K / 16][rows][16] per band, so one 32-byte load holds the 16 weights of a chunk for two rows, each
//         against the input chunk broadcast to both 128-bit halves: lanes 0-3 sum the first row, 4-7 the second.
//         The signed weights meet the signed inputs through VPSIGNB (|w| unsigned, sign(w) moved onto x).
//   int4: [K / 64][rows][32 bytes] per band (byte j: weight j low nibble, j + 32 high), scales [K / 64][rows]
//         (scale, min, scale, min): the low nibbles are group 2s, the high nibbles group 2s + 1, each one block.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace vn_idot {

constexpr int64_t kBlock = 32;  // inputs per int8 factor (one int4 group; two int8 weight chunks)

inline int64_t blocks(int64_t K) { return (K + kBlock - 1) / kBlock; }

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Rows x [M, K] fp32 (K a multiple of 16) -> xq [M, K] int8, d [M][blocks(K)] (x ~= xq * d) and sum
// [M][blocks(K)], each block's exact fp32 sum of x. A last block of 16 inputs (K % 32 == 16) has its own factor.
inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* d, float* sum) {
  const int64_t nb = blocks(K);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xr = x + m * K + b * kBlock;
      const int n = static_cast<int>(std::min(kBlock, K - b * kBlock)) / 8;  // 4 or 2 vectors of 8
      __m256 v[4], mx = _mm256_setzero_ps(), s = _mm256_setzero_ps();
      int nan = 0;
      for (int i = 0; i < n; ++i) {
        v[i] = _mm256_loadu_ps(xr + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
        s = _mm256_add_ps(s, v[i]);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
      }
      const float amax = hmax(mx);
      const int64_t at = m * nb + b;
      sum[at] = hsum(s);
      d[at] = nan ? NAN : amax / 127.f;
      const __m256 up = _mm256_set1_ps(amax > 0.f && !nan ? 127.f / amax : 0.f);
      __m256i q[4];
      for (int i = 0; i < n; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], up));
      int8_t* dst = xq + m * K + b * kBlock;
      // The packs work per 128-bit half: 4-byte groups come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] q0[4:8] ..
      const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      if (n == 4) {
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permutevar8x32_epi32(w, perm));
      } else {
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_setzero_si256());
        const __m256i o = _mm256_permutevar8x32_epi32(w, perm);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(o));
      }
    }
}

// Input rows made int8 (quantize_rows), with each block's factor and exact sum.
struct Rows {
  int64_t M, K, nb;
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  Rows(const float* x, int64_t M_, int64_t K_) : M(M_), K(K_), nb(blocks(K_)), q(M_ * K_), d(M_ * nb), sum(M_ * nb) {
    quantize_rows(x, M, K, q.data(), d.data(), sum.data());
  }
  const int8_t* at(int64_t m) const { return q.data() + m * K; }
  const float* d_at(int64_t m) const { return d.data() + m * nb; }
  const float* sum_at(int64_t m) const { return sum.data() + m * nb; }
};

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

// Sum of the int8 pair products of 32 unsigned bytes u and 32 signed bytes s: 8 int32 lanes.
inline __m256i dot_us(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// The NB (1..4) rows of the int8 band at `band` against input rows 0 .. MB - 1 (xq rows of stride K, d of stride
// blocks(K)): out[i * NB + j] = row i . band row j, times scale[j]. pf: the band to prefetch meanwhile, or null.
template <int MB, int NB>
inline void tile_int8(const int8_t* band, const float* scale, const int8_t* xq, const float* d, int64_t K,
                      float* out, const int8_t* pf) {
  constexpr int P = (NB + 1) / 2;  // row pairs per 32-byte load
  const int64_t chunks = K / 16, nb = blocks(K);
  __m256 acc[MB][P];
  for (int i = 0; i < MB; ++i)
    for (int q = 0; q < P; ++q) acc[i][q] = _mm256_setzero_ps();
  const auto load = [&](const int8_t* p, int q) {
    return 2 * q + 1 < NB ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * q))
                          : _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * q)));
  };
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t c0 = 2 * b, cn = std::min<int64_t>(2, chunks - c0);
    __m256i w[2][P], u[2][P];
    for (int c = 0; c < cn; ++c) {
      const int8_t* p = band + (c0 + c) * 16 * NB;
      if (pf) _mm_prefetch(reinterpret_cast<const char*>(pf + (c0 + c) * 16 * NB), _MM_HINT_T1);
      for (int q = 0; q < P; ++q) {
        w[c][q] = load(p, q);
        u[c][q] = _mm256_abs_epi8(w[c][q]);
      }
    }
    for (int i = 0; i < MB; ++i) {
      const int8_t* xr = xq + i * K + c0 * 16;
      __m256i s[P];
      for (int q = 0; q < P; ++q) s[q] = _mm256_setzero_si256();
      for (int c = 0; c < cn; ++c) {
        const __m256i xv = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xr + 16 * c)));
        for (int q = 0; q < P; ++q) s[q] = _mm256_add_epi32(s[q], dot_us(u[c][q], _mm256_sign_epi8(xv, w[c][q])));
      }
      const __m256 f = _mm256_broadcast_ss(d + i * nb + b);
      for (int q = 0; q < P; ++q) acc[i][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[q]), f, acc[i][q]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int q = 0; q < P; ++q) {
      // [sum of lanes 0-3, of 4-7] = the pair's two rows
      const __m128 h = _mm_hadd_ps(_mm256_castps256_ps128(acc[i][q]), _mm256_extractf128_ps(acc[i][q], 1));
      const __m128 r = _mm_hadd_ps(h, h);  // [row 2q, row 2q + 1, ...]
      out[i * NB + 2 * q] = _mm_cvtss_f32(r) * scale[2 * q];
      if (2 * q + 1 < NB) out[i * NB + 2 * q + 1] = _mm_cvtss_f32(_mm_shuffle_ps(r, r, 1)) * scale[2 * q + 1];
    }
}

// The NB (1..4) rows of the int4 band at `band` (scales at `sm`) against input rows 0 .. MB - 1:
// out[i * NB + j] = row i . band row j.
template <int MB, int NB>
inline void tile_int4(const uint8_t* band, const float* sm, const int8_t* xq, const float* d, const float* xsum,
                      int64_t K, float* out, const uint8_t* pf) {
  const int64_t nb = blocks(K);
  const __m256i low = _mm256_set1_epi8(15);
  __m256 acc[MB][NB];
  float mins[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      acc[i][j] = _mm256_setzero_ps();
      mins[i][j] = 0.f;
    }
  for (int64_t sb = 0; sb < K / 64; ++sb) {
    const uint8_t* p = band + sb * NB * 32;
    const float* s = sm + sb * NB * 4;
    if (pf)
      for (int l = 0; l < NB * 32; l += 64) _mm_prefetch(reinterpret_cast<const char*>(pf + sb * NB * 32 + l), _MM_HINT_T1);
    for (int j = 0; j < NB; ++j) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * j));
      const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
      for (int i = 0; i < MB; ++i) {
        const int8_t* xr = xq + i * K + sb * 64;
        const float* di = d + i * nb + 2 * sb;
        const float* si = xsum + i * nb + 2 * sb;
        const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr));
        const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 32));
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_us(lo, x0)), _mm256_set1_ps(s[4 * j] * di[0]), acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_us(hi, x1)), _mm256_set1_ps(s[4 * j + 2] * di[1]), acc[i][j]);
        mins[i][j] += s[4 * j + 1] * si[0] + s[4 * j + 3] * si[1];
      }
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) out[i * NB + j] = hsum(acc[i][j]) + mins[i][j];
}

}  // namespace vn_idot
