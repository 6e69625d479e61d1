// Weight-streaming bf16 linear for small batches (decode): y[M, N] = x[M, K] @ w[N, K]^T.
//
// At decode sizes a linear layer only has to stream its weights once; oneDNN reaches about half the
// memory bandwidth there on AVX512-BF16 CPUs without AMX. Here each thread streams a band of weight
// rows once, four at a time, against up to four input rows held in registers, with VDPBF16PS
// (bf16 pairs multiplied and accumulated in fp32). Built only where the compiler targets AVX512-BF16;
// elsewhere the op is not registered and callers use F.linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

template <int MB, int NB>
inline void tile(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  __m512 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j)
      wv[j] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + (n0 + j) * K + k));
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(x + (m0 + i) * K + k));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      const c10::BFloat16 v(_mm512_reduce_add_ps(acc[i][j]));
      y[(m0 + i) * N + n0 + j] = v.x;
    }
}

template <int NB>
inline void column_band(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t M, int64_t K, int64_t N,
                        int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) tile<4, NB>(x, w, y, K, N, m0, n0);
  switch (M - m0) {
    case 3: tile<3, NB>(x, w, y, K, N, m0, n0); break;
    case 2: tile<2, NB>(x, w, y, K, N, m0, n0); break;
    case 1: tile<1, NB>(x, w, y, K, N, m0, n0); break;
    default: break;
  }
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16 only");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = w.size(0);
  auto y = at::empty({M, N}, xc.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t bands = N / 4;
  at::parallel_for(0, bands, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) column_band<4>(xp, wp, yp, M, K, N, b * 4);
  });
  for (int64_t n0 = bands * 4; n0 < N; ++n0) column_band<1>(xp, wp, yp, M, K, N, n0);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_neuron, m) { m.def("linear_bf16(Tensor x, Tensor w) -> Tensor"); }

TORCH_LIBRARY_IMPL(vllm_neuron, CPU, m) { m.impl("linear_bf16", &linear_bf16); }

#endif  // __AVX512BF16__
