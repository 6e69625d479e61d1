// Weight-only int8 and int4 linears for small batches (decode): y[M, N] = x[M, K] @ W^T, W dequantized in
// registers.
//
// A decode step streams every weight once, so its time follows the weight bytes. Each thread streams a
// band of four weight rows once per four input rows, widens the weights to fp32 in registers and
// multiplies them against the input rows held in fp32 (fp32 products and sums, so an fp32 model gets
// the dequantized matmul's result). Built where the compiler targets AVX-512; elsewhere the ops are
// not registered and callers dequantize and use F.linear.
//
// int8 (model/layers/quant_int8.py): q [N, K] int8, one fp32 scale per output row (w = q * scale[n]),
// applied once per output.
// int4 (model/layers/quant_int4.py): groups of 32 weights along K with an fp32 (scale, min) pair each
// (w = q * scale + min, q in 0..15). Two groups form a 64-weight superblock of 32 bytes whose byte j
// holds weight j in its low nibble and weight j + 32 in its high nibble, so 16 bytes widen to two
// vectors of 16 consecutive weights with one AND and one shift.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

inline void put(float* p, float v) { *p = v; }
inline void put(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }
inline void put(c10::Half* p, float v) { *p = c10::Half(v); }

struct Int8 {
  const int8_t* w;
  const float* scale;

  template <int MB, int NB, typename T>
  void tile(const float* x, T* y, int64_t K, int64_t N, int64_t m0, int64_t n0) const {
    __m512 acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      __m512 wv[NB];
      for (int j = 0; j < NB; ++j) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n0 + j) * K + k));
        wv[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
      }
      for (int i = 0; i < MB; ++i) {
        const __m512 xv = _mm512_loadu_ps(x + (m0 + i) * K + k);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) put(y + (m0 + i) * N + n0 + j, _mm512_reduce_add_ps(acc[i][j]) * scale[n0 + j]);
  }
};

struct Int4 {
  const uint8_t* w;
  const float* sm;

  template <int MB, int NB, typename T>
  void tile(const float* x, T* y, int64_t K, int64_t N, int64_t m0, int64_t n0) const {
    const int64_t row_bytes = K / 2, groups = K / 32;
    const __m512i low = _mm512_set1_epi32(15);
    __m512 acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < K; kb += 64) {
      const int64_t g = kb / 32;
      for (int64_t h = 0; h < 32; h += 16) {  // weights kb+h.. (group g) and kb+32+h.. (group g+1)
        __m512 wlo[NB], whi[NB];
        for (int j = 0; j < NB; ++j) {
          const __m128i b =
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n0 + j) * row_bytes + kb / 2 + h));
          const __m512i v = _mm512_cvtepu8_epi32(b);
          const float* p = sm + ((n0 + j) * groups + g) * 2;
          wlo[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low)), _mm512_set1_ps(p[0]),
                                   _mm512_set1_ps(p[1]));
          whi[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), _mm512_set1_ps(p[2]),
                                   _mm512_set1_ps(p[3]));
        }
        for (int i = 0; i < MB; ++i) {
          const __m512 xlo = _mm512_loadu_ps(x + (m0 + i) * K + kb + h);
          const __m512 xhi = _mm512_loadu_ps(x + (m0 + i) * K + kb + 32 + h);
          for (int j = 0; j < NB; ++j) {
            acc[i][j] = _mm512_fmadd_ps(xlo, wlo[j], acc[i][j]);
            acc[i][j] = _mm512_fmadd_ps(xhi, whi[j], acc[i][j]);
          }
        }
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) put(y + (m0 + i) * N + n0 + j, _mm512_reduce_add_ps(acc[i][j]));
  }
};

template <int NB, typename W, typename T>
inline void band(const W& wt, const float* x, T* y, int64_t M, int64_t K, int64_t N, int64_t n0) {
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) wt.template tile<4, NB>(x, y, K, N, m0, n0);
  switch (M - m0) {
    case 3: wt.template tile<3, NB>(x, y, K, N, m0, n0); break;
    case 2: wt.template tile<2, NB>(x, y, K, N, m0, n0); break;
    case 1: wt.template tile<1, NB>(x, y, K, N, m0, n0); break;
    default: break;
  }
}

// Output rows in bands of four across threads, the last N % 4 one at a time; y in x's dtype.
template <typename W>
at::Tensor run(const W& wt, const at::Tensor& x, int64_t N) {
  const auto xf = x.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  auto y = at::empty({M, N}, x.options());
  const float* xp = xf.data_ptr<float>();
  const auto go = [&](auto* yp) {
    const int64_t bands = N / 4;
    at::parallel_for(0, bands, 8, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) band<4>(wt, xp, yp, M, K, N, b * 4);
    });
    for (int64_t n0 = bands * 4; n0 < N; ++n0) band<1>(wt, xp, yp, M, K, N, n0);
  };
  switch (x.scalar_type()) {
    case at::kFloat: go(y.data_ptr<float>()); break;
    case at::kBFloat16: go(y.data_ptr<at::BFloat16>()); break;
    case at::kHalf: go(y.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "x must be float32, bfloat16 or float16");
  }
  return y;
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "x [M, K], q [N, K]");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.numel() == q.size(0) && scale.is_contiguous(),
              "scale must be float32 [N]");
  TORCH_CHECK(x.size(1) % 16 == 0, "K must be a multiple of 16");
  return run(Int8{q.data_ptr<int8_t>(), scale.data_ptr<float>()}, x, q.size(0));
}

at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sm) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == 2 * q.size(1), "x [M, K], q [N, K / 2]");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous(), "q must be contiguous uint8");
  TORCH_CHECK(x.size(1) % 64 == 0, "K must be a multiple of 64");
  TORCH_CHECK(sm.scalar_type() == at::kFloat && sm.is_contiguous() && sm.dim() == 3 && sm.size(0) == q.size(0) &&
                  sm.size(1) == x.size(1) / 32 && sm.size(2) == 2,
              "scales must be float32 [N, K / 32, 2]");
  return run(Int4{q.data_ptr<uint8_t>(), sm.data_ptr<float>()}, x, q.size(0));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_neuron, m) {
  m.def("linear_int8(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor q, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_neuron, CPU, m) {
  m.impl("linear_int8", &linear_int8);
  m.impl("linear_int4", &linear_int4);
}

#endif  // __AVX512F__
