// Activations made int8 per row and group of 32 inputs for the W4A8 / W8A8 tile kernels
// (linear_int4_tiles.cpp, linear_int8_tiles.cpp), and the fp32 / bf16 loads and stores of 16 lanes they share.
// Scale max|x| / 127, codes rounded to nearest even; the group's exact fp32 sum kept beside them (int4's
// minimums meet it; quant_int4.quantize_activations is the reference), and 8 x the codes' sum (int4's centring).
#pragma once
#include "op_table.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace vn_acts {

constexpr int64_t kGroup = 32;  // inputs per activation group (and per int4 weight group)

// The activations of x made int8 per row and group of 32: codes [M][K]; scales, exact sums and 8 x the codes'
// sums [M][K / 32]. The last is stored multiplied so that the int4 kernel subtracts it straight from memory (a
// broadcast operand; computing 8 x qsum there cost a scalar multiply and a register broadcast per group, row
// and 16 columns: the kernel at 16 and 64 rows went from 1.19x the int8 kernel's time to 1.15x).
struct Acts {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  std::vector<int32_t> qsum8;
};
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

template <typename T>
inline void quantize_rows(const T* x, int64_t M, int64_t K, Acts& a) {
  const int64_t G = K / kGroup;
  a.q.resize(M * K);
  a.d.resize(M * G);
  a.sum.resize(M * G);
  a.qsum8.resize(M * G);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const T* p = x + r * K + g * kGroup;
        const __m512 lo = load16(p), hi = load16(p + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, abs_mask), _mm512_and_ps(hi, abs_mask)));
        a.sum[r * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        // IEEE divisions by builtin (DIVSS), which -ffast-math leaves alone (a reciprocal product's last bit
        // would round a tie at .5 the other way than quant_int4.quantize_activations, the tests' reference).
        const __m128 m = _mm_set_ss(amax), levels = _mm_set_ss(127.0f);
        a.d[r * G + g] = _mm_cvtss_f32(_mm_div_ss(m, levels));
        __m512 inv = _mm512_set1_ps(amax > 0.0f ? _mm_cvtss_f32(_mm_div_ss(levels, m)) : 0.0f);
        __asm__("" : "+v"(inv));  // and no folding of 127 / amax into the products
        // Nearest, ties to even (the default rounding mode); |x| * 127 / amax <= 127, so no saturation.
        int8_t* q = a.q.data() + r * K + g * kGroup;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
        a.qsum8[r * G + g] = 8 * _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qlo));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qhi));
      }
  });
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  // Round to nearest even, as c10::BFloat16's conversion does (no AVX512-BF16 needed).
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i out = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(out));
}

// f(std::integral_constant<int, R>(), r0) over M rows in blocks of 8, then the rest.
template <typename F>
inline void row_blocks(int64_t M, F&& f) {
  int64_t r0 = 0;
  for (; r0 + 8 <= M; r0 += 8) f(std::integral_constant<int, 8>(), r0);
  switch (M - r0) {
    case 7: f(std::integral_constant<int, 7>(), r0); break;
    case 6: f(std::integral_constant<int, 6>(), r0); break;
    case 5: f(std::integral_constant<int, 5>(), r0); break;
    case 4: f(std::integral_constant<int, 4>(), r0); break;
    case 3: f(std::integral_constant<int, 3>(), r0); break;
    case 2: f(std::integral_constant<int, 2>(), r0); break;
    case 1: f(std::integral_constant<int, 1>(), r0); break;
    default: break;
  }
}

// The tile kernels' entry: x [M, K] bf16 or fp32 made int8 (`shift`: codes to unsigned, qx + 128), then
// run(acts, y) with y [M, N] in x's dtype (a float* or c10::BFloat16*); the bias checked as float32 [N].
template <typename F>
inline at::Tensor with_int8_rows(const at::Tensor& x_in, int64_t N, const c10::optional<at::Tensor>& bias,
                                 bool shift, F&& run) {
  TORCH_CHECK(x_in.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias must be float32 [N]");
  const auto x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto y = vn_ops::empty({M, N}, x.options());
  if (M == 0) return y;
  Acts a;
  const auto go = [&](const auto* xp, auto* yp) {
    quantize_rows(xp, M, K, a);
    if (shift)
      for (auto& q : a.q) q = static_cast<int8_t>(static_cast<uint8_t>(q) ^ 0x80);
    run(static_cast<const Acts&>(a), yp);
  };
  if (x.scalar_type() == at::kFloat)
    go(x.data_ptr<float>(), y.data_ptr<float>());
  else
    go(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  return y;
}

}  // namespace vn_acts
