// int8 weights against int8 activations (W8A8) by VPDPBUSD outer products: y[M, N] = x[M, K] @ W^T (+ bias),
// W = q * scale[n] (quant_int8: symmetric, one scale per output row).
//
// The same scheme as the int4 tile kernel (linear_int4_tiles.cpp; activations made int8 per row and group of
// 32, int8_acts.h). VPDPBUSD wants one operand unsigned: the activation codes are shifted to qx + 128 (1..255)
// and each group's sum over a column gains 128 * sum_k q_k, which the weights' copy holds per column and group
// (`corr`) and the kernel subtracts before scaling:
//   sum_k w_k x_k ~= scale[n] * sum_g d_x[g] * (sum_{k in g} (qx_k + 128) q_k - corr[n][g]),
// 8 VPDPBUSD, a subtraction, a conversion and an FMA per group, row and 16 columns (11 instructions per 512
// products where bf16 takes 16); the column scale once at the end.
//
// Weights in tile order (quant_int8.to_tiles): per 16 output columns, per 4 inputs, 64 bytes (column c's 4
// codes in its 4 bytes), read in place (no unpacking); `corr` int32 [N / 16][K / 32][16].

#include <type_traits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "int8_acts.h"

namespace {

using vn_acts::Acts;
using vn_acts::kGroup;

constexpr int64_t kCols = 16;  // output columns per block (one zmm of sums)
constexpr int64_t kAhead = 2;  // column blocks ahead prefetched into L2

template <int R, typename T>
void block(const int8_t* w, const int32_t* corr, const float* scale, const Acts& a, int64_t r0, int64_t K, T* y,
           int64_t N, const float* bias, const char* pf, int64_t pflines) {
  const int64_t G = K / kGroup;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  int64_t line = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (pf != nullptr)  // this block's share of the block kAhead on, spread over the groups
      for (const int64_t end = (g + 1) * pflines / G; line < end; ++line) _mm_prefetch(pf + 64 * line, _MM_HINT_T1);
    __m512i isum[R];
    for (int i = 0; i < R; ++i) isum[i] = _mm512_setzero_si512();
    const int8_t* wg = w + g * kGroup * kCols;
    for (int t = 0; t < 8; ++t) {
      const __m512i wv = _mm512_loadu_si512(wg + t * 64);
      for (int i = 0; i < R; ++i) {
        const int32_t xq = *reinterpret_cast<const int32_t*>(a.q.data() + (r0 + i) * K + g * kGroup + 4 * t);
        isum[i] = _mm512_dpbusd_epi32(isum[i], _mm512_set1_epi32(xq), wv);
      }
    }
    const __m512i c = _mm512_loadu_si512(corr + g * kCols);
    for (int i = 0; i < R; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[i], c)),
                               _mm512_set1_ps(a.d[(r0 + i) * G + g]), acc[i]);
  }
  const __m512 s = _mm512_loadu_ps(scale), b = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias);
  for (int i = 0; i < R; ++i) vn_acts::store16(y + (r0 + i) * N, _mm512_fmadd_ps(acc[i], s, b));
}

template <typename T>
void run(const Acts& a, const int8_t* codes, const int32_t* corr, const float* scale, const float* bias, T* y,
         int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / kCols, G = K / kGroup, block_bytes = K * kCols;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t cb = b0; cb < b1; ++cb) {
      const int8_t* w = codes + cb * block_bytes;
      const int32_t* cc = corr + cb * G * kCols;
      const float* bb = bias == nullptr ? nullptr : bias + cb * kCols;
      T* yb = y + cb * kCols;
      const bool ahead = cb + kAhead < b1;
      const char* pf = reinterpret_cast<const char*>(codes + (cb + kAhead) * block_bytes);
      const int64_t row_blocks = (M + 7) / 8, lines = block_bytes / 64;
      int64_t rb = 0;
      vn_acts::row_blocks(M, [&](auto rows, int64_t r0) {
        const int64_t l0 = rb * lines / row_blocks, l1 = (rb + 1) * lines / row_blocks;
        block<decltype(rows)::value>(w, cc, scale + cb * kCols, a, r0, K, yb, N, bb, ahead ? pf + 64 * l0 : nullptr,
                                     l1 - l0);
        ++rb;
      });
    }
  });
}

// x [M, K] (bf16 or fp32) @ the int8 weight in tile order: codes int8 [N, K], corr int32 [N / 16, K / 32, 16],
// scale float32 [N] (quant_int8.to_tiles); bias float32 [N] or none; y in x's dtype.
at::Tensor linear_int8_tiles(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& corr,
                             const at::Tensor& scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.dim() == 2 && x_in.size(-1) == codes.size(1), "x [M, K], codes [N, K]");
  const int64_t K = x_in.size(-1), N = codes.size(0);
  TORCH_CHECK(K % kGroup == 0 && N % kCols == 0, "K must be a multiple of 32 and N of 16");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous(), "codes must be contiguous int8");
  TORCH_CHECK(corr.scalar_type() == at::kInt && corr.is_contiguous() && corr.numel() == N * K / kGroup,
              "corr must be int32 [N / 16, K / 32, 16]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N, "scale must be float32 [N]");
  return vn_acts::with_int8_rows(x_in, N, bias, true, [&](const Acts& a, auto* yp) {
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    run(a, codes.data_ptr<int8_t>(), corr.data_ptr<int32_t>(), scale.data_ptr<float>(), bp, yp, a.q.size() / K, K, N);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_neuron, m) {
  m.def("linear_int8_tiles(Tensor x, Tensor codes, Tensor corr, Tensor scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_neuron, CPU, m) { m.impl("linear_int8_tiles", &linear_int8_tiles); }

#endif  // AVX512-VNNI
