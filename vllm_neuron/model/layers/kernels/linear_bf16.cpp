// Weight-streaming linear for small batches (decode): y[M, N] = x[M, K] @ w[N, K]^T.
//
// At decode sizes a linear layer only has to stream its weights once; oneDNN reaches about half the
// memory bandwidth there. Here each thread streams a band of weight rows once, four at a time,
// against up to four input rows held in registers. One code path per instruction set, chosen when
// the library is built (kernels/__init__.py picks the compiler flags per CPU class):
//   AVX512-BF16: bf16 pairs multiplied and accumulated in fp32 by VDPBF16PS (linear_bf16);
//   AVX2 + FMA:  bf16 widened to fp32 by a 16-bit shift, then FMA (linear_bf16), and fp32 (linear_f32).
// Elsewhere the ops are not registered and callers use F.linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

namespace {

// Runs tile<MB, NB> over every (row block, column band): bands of 4 weight rows in parallel.
template <template <int, int> class Tile, typename T>
void run_tiles(const T* x, const T* w, T* y, int64_t M, int64_t K, int64_t N) {
  auto band = [&](auto nb, int64_t n0) {
    constexpr int NB = decltype(nb)::value;
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) Tile<4, NB>::run(x, w, y, K, N, m0, n0);
    switch (M - m0) {
      case 3: Tile<3, NB>::run(x, w, y, K, N, m0, n0); break;
      case 2: Tile<2, NB>::run(x, w, y, K, N, m0, n0); break;
      case 1: Tile<1, NB>::run(x, w, y, K, N, m0, n0); break;
      default: break;
    }
  };
  const int64_t bands = N / 4;
  at::parallel_for(0, bands, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) band(std::integral_constant<int, 4>(), b * 4);
  });
  for (int64_t n0 = bands * 4; n0 < N; ++n0) band(std::integral_constant<int, 1>(), n0);
}

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 values -> 8 fp32 (bf16 is the upper half of an fp32), and one fp32 back to T.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store1(float* y, float v) { *y = v; }
inline void store1(uint16_t* y, float v) { *y = c10::BFloat16(v).x; }

// fp32 FMA over 8 lanes; T is float or bf16 (as uint16_t bits, widened on load).
template <typename T>
struct Avx2 {
  template <int MB, int NB>
  struct Tile {
    static void run(const T* x, const T* w, T* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
      __m256 acc[MB][NB];
      for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; k += 8) {
        __m256 wv[NB];
        for (int j = 0; j < NB; ++j) wv[j] = load8(w + (n0 + j) * K + k);
        for (int i = 0; i < MB; ++i) {
          const __m256 xv = load8(x + (m0 + i) * K + k);
          for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
      }
      for (int i = 0; i < MB; ++i)
        for (int j = 0; j < NB; ++j) store1(y + (m0 + i) * N + n0 + j, hsum256(acc[i][j]));
    }
  };
};

#if !defined(__AVX512BF16__)
template <int MB, int NB>
using TileBf16 = Avx2<uint16_t>::Tile<MB, NB>;
#endif
#endif  // AVX2 + FMA

#if defined(__AVX512BF16__)
template <int MB, int NB>
struct TileBf16 {
  static void run(const uint16_t* x, const uint16_t* w, uint16_t* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
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
      for (int j = 0; j < NB; ++j) y[(m0 + i) * N + n0 + j] = c10::BFloat16(_mm512_reduce_add_ps(acc[i][j])).x;
  }
};
#endif

void check_args(const at::Tensor& x, const at::Tensor& w, at::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == dtype && w.scalar_type() == dtype, "x and w must be ", dtype);
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  check_args(x, w, at::kBFloat16);
  auto xc = x.contiguous();
  auto y = at::empty({xc.size(0), w.size(0)}, xc.options());
  run_tiles<TileBf16>(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()),
                      reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                      reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), xc.size(0), xc.size(1), w.size(0));
  return y;
}

#if defined(__AVX2__) && defined(__FMA__)
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w) {
  check_args(x, w, at::kFloat);
  auto xc = x.contiguous();
  auto y = at::empty({xc.size(0), w.size(0)}, xc.options());
  run_tiles<Avx2<float>::Tile>(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), xc.size(0), xc.size(1),
                         w.size(0));
  return y;
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_neuron, m) {
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
#if defined(__AVX2__) && defined(__FMA__)
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(vllm_neuron, CPU, m) {
  m.impl("linear_bf16", &linear_bf16);
#if defined(__AVX2__) && defined(__FMA__)
  m.impl("linear_f32", &linear_f32);
#endif
}

#endif  // AVX512-BF16 or AVX2 + FMA
