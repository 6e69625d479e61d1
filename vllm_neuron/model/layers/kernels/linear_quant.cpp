// Weight-only int8 and int4 linears for small batches (decode): y[M, N] = x[M, K] @ W^T, W dequantized in
// registers.
//
// A decode step streams every weight once, so its time follows the weight bytes, and the bytes arrive at
// full speed only as one sequential stream per thread: four weight rows read side by side (four streams
// 576 bytes apart on the bundled model) reached a third of one core's read bandwidth. So the weights are
// stored in bands of four output rows (quant_bands.py), a band's rows interleaved chunk by chunk, and
// each thread reads its bands front to back, widening the weights to fp32 in registers and multiplying
// them against up to four input rows held in fp32 (fp32 products and sums: an fp32 model gets the
// dequantized matmul's result). The scale is applied once per output after the dot product. With AVX512-BF16,
// bf16 inputs of five or more rows (int4: two) take bands widened once to bf16 and VDPBF16PS instead, and with
// AVX512-VNNI: one to four bf16 rows (to 16 on AMX CPUs) against int8 take integer products (int8_vnni.h; below).
// AVX2 builds (no AVX-512): one to 16 rows of any input dtype take integer products on inputs made int16
// (int_dot_avx2.h; int_dot_rows below), int8 and int4 alike; AVX512-VNNI: one bf16 row against int4 too
// (int4_vnni.h).
//
// One code path per vector width (simd.h), chosen when the library is built: 16 lanes where the compiler
// targets AVX-512, 8 lanes on AVX2 + FMA. Elsewhere the ops are not registered and callers dequantize and use
// F.linear.
//
// int8 (model/layers/quant_int8.py): q [N, K] int8, one fp32 scale per output row (w = q * scale[n]);
// within a band, chunks of 16 weights: [K / 16][rows][16].
// int4 (model/layers/quant_int4.py): groups of 32 weights along K with an fp32 (scale, min) pair each
// (w = q * scale + min, q in 0..15). Two groups form a 64-weight superblock of 32 bytes whose byte j
// holds weight j in its low nibble and weight j + 32 in its high nibble, so bytes widen to two vectors of
// consecutive weights with one AND and one shift; within a band, [K / 64][rows][32 bytes], and the
// scales [K / 64][rows][4 floats].
// The ATen headers used, not ATen/ATen.h: parsing all of that doubles the first start's kernel build; and inside
// the CPU-class guard, so that a class without these kernels compiles the file in no time.

#include <algorithm>
#include <type_traits>
#include <vector>

#include "op_isa.h"

#ifdef VN_OPS_LINEAR_QUANT
#include "op_table.h"
#include <ATen/Parallel.h>
#include "simd.h"
#if defined(__AVX512BF16__)
#include "int4_table.h"
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "int4_vnni.h"
#include "int8_vnni.h"
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
#include "int_dot_avx2.h"
#endif

namespace {

using vn_simd::Vec;

constexpr int64_t kBand = 4;  // output rows per band (quant_bands.BAND)

using R = Vec::R;
constexpr int W = Vec::W;

inline void put(float* p, float v) { *p = v; }
inline void put(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }
inline void put(c10::Half* p, float v) { *p = c10::Half(v); }

// Part [i, i + 1) of `parts` of the byte range [p, p + bytes) into cache, ahead of use.
inline void prefetch_part(const void* p, int64_t bytes, int64_t i, int64_t parts) {
  const int64_t a = (bytes * i / parts) & ~int64_t{63}, b = bytes * (i + 1) / parts;
  vn_simd::prefetch(static_cast<const char*>(p) + a, b - a);
}

struct Int8 {
  const int8_t* w;
  const float* scale;

  void prefetch_band(int64_t n0, int64_t K, int64_t i, int64_t parts) const {
    prefetch_part(w + n0 * K, kBand * K, i, parts);
  }

  // NB rows starting at n0 (one band), MB input rows starting at m0.
  template <int MB, int NB, typename T>
  void tile(const float* x, T* y, int64_t K, int64_t N, int64_t m0, int64_t n0) const {
    const int8_t* band = w + n0 * K;
    R acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = Vec::zero();
    for (int64_t k = 0; k < K; k += 16) {
      const int8_t* p = band + k * NB;
      for (int h = 0; h < 16; h += W) {
        R wv[NB];
        for (int j = 0; j < NB; ++j) wv[j] = Vec::i8(p + 16 * j + h);
        for (int i = 0; i < MB; ++i) {
          const R xv = Vec::load(x + (m0 + i) * K + k + h);
          for (int j = 0; j < NB; ++j) acc[i][j] = Vec::fma(xv, wv[j], acc[i][j]);
        }
      }
    }
    vn_simd::store_tile(acc, y, N, m0, n0, scale, [](T* p, float v) { put(p, v); });
  }
};

struct Int4 {
  const uint8_t* w;
  const float* sm;

  void prefetch_band(int64_t n0, int64_t K, int64_t i, int64_t parts) const {
    prefetch_part(w + n0 * (K / 2), kBand * K / 2, i, parts);
    prefetch_part(sm + n0 * (K / 16), kBand * K / 16 * sizeof(float), i, parts);
  }

  template <int MB, int NB, typename T>
  void tile(const float* x, T* y, int64_t K, int64_t N, int64_t m0, int64_t n0) const {
    const uint8_t* band = w + n0 * (K / 2);
    const float* band_sm = sm + n0 * (K / 16);
    R acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = Vec::zero();
    for (int64_t kb = 0; kb < K; kb += 64) {
      const uint8_t* p = band + (kb / 64) * NB * 32;
      const float* s = band_sm + (kb / 64) * NB * 4;  // per row: scale, min of group 2i, then of 2i + 1
      for (int h = 0; h < 32; h += W) {  // weights kb+h.. (first group) and kb+32+h.. (second group)
        R wlo[NB], whi[NB];
        for (int j = 0; j < NB; ++j) {
          R lo, hi;
          Vec::u4(p + 32 * j + h, lo, hi);
          wlo[j] = Vec::fma(lo, Vec::set1(s[4 * j]), Vec::set1(s[4 * j + 1]));
          whi[j] = Vec::fma(hi, Vec::set1(s[4 * j + 2]), Vec::set1(s[4 * j + 3]));
        }
        for (int i = 0; i < MB; ++i) {
          const R xlo = Vec::load(x + (m0 + i) * K + kb + h);
          const R xhi = Vec::load(x + (m0 + i) * K + kb + 32 + h);
          for (int j = 0; j < NB; ++j) acc[i][j] = Vec::fma(xhi, whi[j], Vec::fma(xlo, wlo[j], acc[i][j]));
        }
      }
    }
    vn_simd::store_tile(acc, y, N, m0, n0, nullptr, [](T* p, float v) { put(p, v); });
  }
};

// One band (NB rows at n0) against every input row, four at a time: the band is read from memory once
// and stays in L1 for the later row blocks. From five rows on, a band takes several row blocks of compute
// while its memory stream would idle, so the full band two on (below `nend`, the thread's range) is
// prefetched in slices, one before each row block.
template <int NB, typename Q, typename T>
inline void band(const Q& wt, const float* x, T* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t nend) {
  const int64_t blocks = (M + 3) / 4, ahead = n0 + 2 * kBand;
  const bool prefetch = M > 4 && NB == kBand && ahead + kBand <= nend;
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) {
    if (prefetch) wt.prefetch_band(ahead, K, m0 / 4, blocks);
    wt.template tile<4, NB>(x, y, K, N, m0, n0);
  }
  if (prefetch && m0 < M) wt.prefetch_band(ahead, K, m0 / 4, blocks);
  switch (M - m0) {
    case 3: wt.template tile<3, NB>(x, y, K, N, m0, n0); break;
    case 2: wt.template tile<2, NB>(x, y, K, N, m0, n0); break;
    case 1: wt.template tile<1, NB>(x, y, K, N, m0, n0); break;
    default: break;
  }
}

// x as fp32 rows: x itself when it is contiguous fp32, else widened into buf by a plain loop (an ATen
// conversion costs more than the widening at decode sizes, on every linear of every step).
const float* fp32_rows(const at::Tensor& x, std::vector<float>& buf) {
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>();
  buf.resize(x.numel());
  if (x.scalar_type() == at::kBFloat16) {
    const auto* p = x.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < x.numel(); ++i) buf[i] = static_cast<float>(p[i]);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kHalf, "x must be float32, bfloat16 or float16");
    const auto* p = x.data_ptr<at::Half>();
    for (int64_t i = 0; i < x.numel(); ++i) buf[i] = static_cast<float>(p[i]);
  }
  return buf.data();
}

#if defined(__AVX512BF16__)
// bf16 inputs from five rows on (int4: from two, linear_int4): re-widening a band to fp32 for every four-row
// block made the step compute-bound (int8 decode_b16 1.9x bf16's). Here each band is widened once to bf16 in an
// L1 buffer (int8: exact, |q| <= 128 needs 8 significant bits, the scale applied per output; int4: the
// dequantized weight rounded to bf16, as prefill uses it) and runs VDPBF16PS tiles against the input rows as
// they are, as the bf16 kernel does: products exact, sums fp32. One to four int8 rows (to 16 on AMX CPUs) take VPDPWSSD instead (vnni_rows).
template <int MB>
void bf16_tile(const uint16_t* x, const uint16_t* wb, c10::BFloat16* y, int64_t K, int64_t N, int64_t m0,
               int64_t n0, const float* scale) {
  R acc[MB][kBand];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < kBand; ++j) acc[i][j] = Vec::zero();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[kBand];
    for (int j = 0; j < kBand; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wb + j * K + k);
    for (int i = 0; i < MB; ++i) {
      const auto xv = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * K + k);
      for (int j = 0; j < kBand; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  vn_simd::store_tile(acc, y, N, m0, n0, scale, [](c10::BFloat16* p, float v) { put(p, v); });
}

// Band n0's int8 chunks -> wb[4][K] bf16, row by row (exact).
inline void widen_band_bf16(const Int8& wt, int64_t n0, int64_t K, uint16_t* wb) {
  const int8_t* band = wt.w + n0 * K;
  for (int64_t k = 0; k < K; k += 32)
    for (int j = 0; j < kBand; ++j) {
      const __m512 lo = Vec::i8(band + k * kBand + 16 * j);
      const __m512 hi = Vec::i8(band + (k + 16) * kBand + 16 * j);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wb + j * K + k), (__m256i)_mm512_cvtneps_pbh(lo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(wb + j * K + k + 16), (__m256i)_mm512_cvtneps_pbh(hi));
    }
}

// Band n0's int4 superblocks -> wb[4][K]: q * scale + min in fp32, rounded to bf16 (int4_table.h: the weight the
// prefill path's unpack_int4 gives oneDNN, so decode and prefill see the same weights).
inline void widen_band_bf16(const Int4& wt, int64_t n0, int64_t K, uint16_t* wb) {
  const uint8_t* band = wt.w + n0 * (K / 2);
  const float* band_sm = wt.sm + n0 * (K / 16);
  for (int64_t kb = 0; kb < K; kb += 64)
    for (int j = 0; j < kBand; ++j)
      vn_int4::superblock_bf16(band + (kb / 64) * kBand * 32 + 32 * j, band_sm + (kb / 64) * kBand * 4 + 4 * j,
                               wb + j * K + kb);
}

inline const float* out_scale(const Int8& wt) { return wt.scale; }
inline const float* out_scale(const Int4&) { return nullptr; }

// The last N % 4 output rows of a bf16 input, as the fp32 path does them.
template <typename Q>
void tail_rows(const Q& wt, const at::Tensor& x, c10::BFloat16* yp, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), n_tail = N / kBand * kBand;
  if (n_tail == N) return;
  std::vector<float> buf;
  const float* xf = fp32_rows(x, buf);
  switch (N - n_tail) {
    case 3: band<3>(wt, xf, yp, M, K, N, n_tail, N); break;
    case 2: band<2>(wt, xf, yp, M, K, N, n_tail, N); break;
    case 1: band<1>(wt, xf, yp, M, K, N, n_tail, N); break;
    default: break;
  }
}

template <typename Q>
at::Tensor bf16_rows(const Q& wt, const at::Tensor& x, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  auto y = vn_ops::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t bands = N / kBand;
  at::parallel_for(0, bands, 8, [&](int64_t b0, int64_t b1) {
    std::vector<uint16_t> wb(kBand * K);
    const int64_t blocks = (M + 3) / 4;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBand;
      widen_band_bf16(wt, n0, K, wb.data());
      const bool prefetch = b + 2 < b1;
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4) {
        if (prefetch) wt.prefetch_band(n0 + 2 * kBand, K, m0 / 4, blocks);
        bf16_tile<4>(xp, wb.data(), yp, K, N, m0, n0, out_scale(wt));
      }
      if (prefetch && m0 < M) wt.prefetch_band(n0 + 2 * kBand, K, m0 / 4, blocks);
      switch (M - m0) {
        case 3: bf16_tile<3>(xp, wb.data(), yp, K, N, m0, n0, out_scale(wt)); break;
        case 2: bf16_tile<2>(xp, wb.data(), yp, K, N, m0, n0, out_scale(wt)); break;
        case 1: bf16_tile<1>(xp, wb.data(), yp, K, N, m0, n0, out_scale(wt)); break;
        default: break;
      }
    }
  });
  tail_rows(wt, x, yp, N);
  return y;
}

#if defined(__AVX512VNNI__)
// int8 against bf16 input rows: VPDPWSSD on the inputs made int16 (int8_vnni.h), four rows at a time against
// each band while it is in L1. Measured on one decode step's linears (2 threads):
//   AMD EPYC (Zen 5, AVX512-BF16 and VNNI): 4 rows 4.4-5.2 ms against 5.8-6.0 widened to fp32, 1 row level;
//   from 5 rows on it lost to the bands widened once to bf16 above (8 rows 6.8-7.5 vs 6.0-6.3 ms, 16 rows
//   11.0-12.4 vs 9.0-9.5; eight-row tiles were slower still).
//   Intel Xeon with AMX: it won at every row count up to the kernel's 16 (5 rows 16.5-17.1 vs 23.4-24.9 ms,
//   8 rows 19.7-21.3 vs 28.8-29.5, 16 rows 32.1-35.0 vs 45.4-49.6), so there it takes them all.
#if defined(__AMX_INT8__)
constexpr int64_t kVnniRows = 16;
#else
constexpr int64_t kVnniRows = 4;
#endif
// While a thread's first row block runs against a band, the band kAhead on is prefetched, one line per
// 16-weight chunk. Left to the hardware prefetcher, the int8 linears of a batch-1 step read 11-12 GB/s where
// the bf16 kernel (which prefetches the same way) read 16-17: 10.8-12.0 -> 8.9-9.6 ms with it (AMX Xeon,
// 2 threads); two to four bands ahead measured alike, one band a little slower.
constexpr int64_t kAhead = 2;
at::Tensor vnni_rows(const Int8& wt, const at::Tensor& x, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), bands = N / kBand;
  auto y = vn_ops::empty({M, N}, x.options());
  std::vector<int16_t> xq(M * K * 2);
  std::vector<float> xs(M * vn_vnni::blocks(K));
  vn_vnni::quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, xq.data(), xs.data());
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, bands, 8, [&](int64_t b0, int64_t b1) {
    float out[4 * kBand];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBand;
      int64_t m0 = 0;
      const int64_t nb = vn_vnni::blocks(K);
      const auto rows = [&](auto mb) {
        constexpr int MB = decltype(mb)::value;
        const int8_t* pf = m0 == 0 && b + kAhead < b1 ? wt.w + (n0 + kAhead * kBand) * K : nullptr;
        vn_vnni::tile<MB>(wt.w + n0 * K, wt.scale + n0, xq.data() + m0 * K * 2, xs.data() + m0 * nb, K, out, pf);
        for (int i = 0; i < MB; ++i)
          for (int j = 0; j < kBand; ++j) put(yp + (m0 + i) * N + n0 + j, out[kBand * i + j]);
        m0 += MB;
      };
      while (M - m0 >= 4) rows(std::integral_constant<int, 4>{});
      switch (M - m0) {
        case 3: rows(std::integral_constant<int, 3>{}); break;
        case 2: rows(std::integral_constant<int, 2>{}); break;
        case 1: rows(std::integral_constant<int, 1>{}); break;
        default: break;
      }
    }
  });
  tail_rows(wt, x, yp, N);
  return y;
}
#endif
#endif

// Full bands in contiguous ranges per thread (one sequential stream each), then the last N % 4 rows,
// which form a band of their own; y in x's dtype.
template <typename Q>
at::Tensor run(const Q& wt, const at::Tensor& x_in, int64_t N) {
  const auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto y = vn_ops::empty({M, N}, x.options());
  std::vector<float> buf;
  const float* xp = fp32_rows(x, buf);
  const auto go = [&](auto* yp) {
    const int64_t bands = N / kBand, n_tail = bands * kBand;
    at::parallel_for(0, bands, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) band<kBand>(wt, xp, yp, M, K, N, b * kBand, b1 * kBand);
    });
    switch (N - n_tail) {
      case 3: band<3>(wt, xp, yp, M, K, N, n_tail, N); break;
      case 2: band<2>(wt, xp, yp, M, K, N, n_tail, N); break;
      case 1: band<1>(wt, xp, yp, M, K, N, n_tail, N); break;
      default: break;
    }
  };
  switch (x.scalar_type()) {
    case at::kFloat: go(y.data_ptr<float>()); break;
    case at::kBFloat16: go(y.data_ptr<at::BFloat16>()); break;
    case at::kHalf: go(y.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "x must be float32, bfloat16 or float16");
  }
  return y;
}

#if (defined(__AVX2__) && !defined(__AVX512F__)) || (defined(__AVX512VNNI__) && defined(__AVX512BW__))
#define VN_INT_DOT 1
#if defined(__AVX512F__)
// AVX512-VNNI: int4 against one bf16 row (int4_vnni.h, which has the A/B that set kIntDotRows; int8: vnni_rows).
constexpr int64_t kIntDotRows = 1;
template <int MB, int NB>
void int_dot_tile(const Int4& wt, const vn_idot::Rows& xq, int64_t K, int64_t m0, int64_t n0, float* out, int64_t pf) {
  vn_idot::tile_int4<vn_idot::Int4Vnni512, MB, NB>(wt.w + n0 * (K / 2), wt.sm + n0 * (K / 16), xq.at(m0), xq.d_at(m0),
                                                 xq.sum_at(m0), K, out, pf < 0 ? nullptr : wt.w + pf * (K / 2));
}
#else
// AVX2: up to kIntDotRows rows of any dtype, int8 and int4 (int_dot_avx2.h, which has the A/B that set it); above,
// the widening path (run).
constexpr int64_t kIntDotRows = 16;
template <int MB, int NB>
void int_dot_tile(const Int8& wt, const vn_idot::Rows& xq, int64_t K, int64_t m0, int64_t n0, float* out, int64_t pf) {
  vn_idot::tile_int8<MB, NB>(wt.w + n0 * K, wt.scale + n0, xq.at(m0), xq.d_at(m0), K, out,
                             pf < 0 ? nullptr : wt.w + pf * K);
}
template <int MB, int NB>
void int_dot_tile(const Int4& wt, const vn_idot::Rows& xq, int64_t K, int64_t m0, int64_t n0, float* out, int64_t pf) {
  vn_idot::tile_int4<vn_idot::Int4Avx2, MB, NB>(wt.w + n0 * (K / 2), wt.sm + n0 * (K / 16), xq.at(m0), xq.d_at(m0),
                                              xq.sum_at(m0), K, out, pf < 0 ? nullptr : wt.w + pf * (K / 2));
}
#endif
constexpr int64_t kIntAhead = 2;  // bands ahead prefetched (as vnni_rows)

template <typename Q>
at::Tensor int_dot_rows(const Q& wt, const at::Tensor& x_in, int64_t N) {
  const auto x = x_in.contiguous();
  const int64_t K = x.size(1);
  auto y = vn_ops::empty({x.size(0), N}, x.options());
  std::vector<float> buf;
  const vn_idot::Rows xq(fp32_rows(x, buf), x.size(0), K, std::is_same_v<Q, Int4>);
  const auto tile = [&](auto mb, auto nb, int64_t m0, int64_t n0, float* out, int64_t pf) {
    int_dot_tile<decltype(mb)::value, decltype(nb)::value>(wt, xq, K, m0, n0, out, pf);
  };
  const auto go = [&](auto* yp) {
    vn_idot::run_bands<kBand>(xq.M, N, kIntAhead, tile, [&](int64_t m, int64_t n, float v) { put(yp + m * N + n, v); });
  };
  switch (x.scalar_type()) {
    case at::kFloat: go(y.data_ptr<float>()); break;
    case at::kBFloat16: go(y.data_ptr<at::BFloat16>()); break;
    default: go(y.data_ptr<at::Half>()); break;  // fp32_rows refused any other dtype
  }
  return y;
}
#endif

// The int8 weights of linear_int8's arguments, checked.
Int8 int8_weights(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "x [M, K], q [N, K]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == q.size(0) && scale.is_contiguous(),
              "scale must be float32 [N]");
  TORCH_CHECK(x.size(1) % 16 == 0, "K must be a multiple of 16");
  return Int8{q.data_ptr<int8_t>(), scale.data_ptr<float>()};
}

// The int4 weights of linear_int4's arguments, checked.
Int4 int4_weights(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sm) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == 2 * q.size(1), "x [M, K], q [N, K / 2]");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous(), "q must be contiguous uint8");
  TORCH_CHECK(x.size(1) % 64 == 0, "K must be a multiple of 64");
  TORCH_CHECK(sm.scalar_type() == at::kFloat && sm.is_contiguous() && sm.dim() == 3 && sm.size(0) == q.size(0) &&
                  sm.size(1) == x.size(1) / 32 && sm.size(2) == 2,
              "scales must be float32 [N, K / 32, 2]");
  return Int4{q.data_ptr<uint8_t>(), sm.data_ptr<float>()};
}

}  // namespace

at::Tensor vn_ops::linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  const Int8 wt = int8_weights(x, q, scale);
#if defined(__AVX512BF16__)
#if defined(__AVX512VNNI__)
  if (x.scalar_type() == at::kBFloat16 && x.size(0) <= kVnniRows) return vnni_rows(wt, x.contiguous(), q.size(0));
#endif
  if (x.scalar_type() == at::kBFloat16 && x.size(0) > 4 && x.size(1) % 32 == 0)
    return bf16_rows(wt, x.contiguous(), q.size(0));
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
  if (x.size(0) <= kIntDotRows) return int_dot_rows(wt, x, q.size(0));
#endif
  return run(wt, x, q.size(0));
}

at::Tensor vn_ops::linear_int4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sm) {
  const Int4 wt = int4_weights(x, q, sm);
#if defined(__AVX512BF16__)
  // From two rows: the band's table widening (widen_band_bf16) costs less than widening it again in fp32 per row
  // block (one step's int4 linears at 4 rows 13.7 -> 10.3 ms, 2-3 rows level; the int4 model's decode_b4
  // 13.03 -> 9.35 ms, 2-core Zen 4 EPYC, 2026-12-06).
  if (x.scalar_type() == at::kBFloat16 && x.size(0) > 1) return bf16_rows(wt, x.contiguous(), q.size(0));
#endif
#if defined(VN_INT_DOT) && defined(__AVX512F__)
  if (x.scalar_type() == at::kBFloat16 && x.size(0) <= kIntDotRows) return int_dot_rows(wt, x, q.size(0));
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
  if (x.size(0) <= kIntDotRows) return int_dot_rows(wt, x, q.size(0));
#endif
  return run(wt, x, q.size(0));
}

#ifdef VN_OPS_QUANT_PATH
// linear_int8 (q int8) or linear_int4 (q uint8) by one named path at any row count, for the A/B benchmark and
// the tests of each path: "int_dot" (int_dot_avx2.h) or "widened" (weights widened to fp32, run).
at::Tensor vn_ops::linear_quant_path(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                                     c10::string_view path) {
  TORCH_CHECK(path == "int_dot" || path == "widened", "path must be 'int_dot' or 'widened', got '", path, "'");
  const bool int_dot = path == "int_dot";
  if (q.scalar_type() == at::kChar) {
    const Int8 wt = int8_weights(x, q, scales);
    return int_dot ? int_dot_rows(wt, x, q.size(0)) : run(wt, x, q.size(0));
  }
  const Int4 wt = int4_weights(x, q, scales);
  return int_dot ? int_dot_rows(wt, x, q.size(0)) : run(wt, x, q.size(0));
}
#endif

#endif  // AVX-512 or AVX2 + FMA
