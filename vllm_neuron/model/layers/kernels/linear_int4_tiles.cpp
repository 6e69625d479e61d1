// int4 weights against int8 activations (W4A8) by VPDPBUSD outer products: y[M, N] = x[M, K] @ W^T (+ bias).
//
// The band kernel (linear_quant.cpp) widens int4 bands to bf16 and runs VDPBF16PS: 32 products per
// instruction, so from a few rows on an int4 step costs a bf16 step plus the widening. VPDPBUSD multiplies
// 64 u8 x s8 pairs per instruction, and a 4-bit code is a u8 as it is; the activations are made int8 per row
// and per group of 32 inputs (scale max|x| / 127, the group's exact fp32 sum kept beside it), as llama.cpp's
// Q8 activations and OpenVINO's dynamic quantization (group 32) do. A group of one output column then sums
// exactly in int32, and w = q * scale + min gives
//   sum_k w_k x_k ~= scale * d_x * sum_k q_k qx_k + min * sum_k x_k,
// two FMAs per group, row and 16 columns against 8 VPDPBUSD: 12 instructions per 512 products where bf16
// takes 16.
//
// Weights come in tile order (quant_int4.to_tiles): per 16 output columns, per 8 inputs, 64 bytes, the 4
// bytes of column c holding its codes for inputs 0-3 (low nibbles) and 4-7 (high nibbles), so one AND and
// one shift give two u8 operands of 16 columns x 4 inputs; the (scale, min) pairs per 16 columns and group
// as two vectors of 16 floats. A thread takes a contiguous range of column blocks, unpacks each block's
// codes once into an L1 buffer, and runs every row block of up to 8 rows against it (8 x 16 int32 and 8 x 16
// fp32 sums in registers).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

constexpr int64_t kCols = 16;   // output columns per block (one zmm of sums)
constexpr int64_t kGroup = 32;  // inputs per weight group and per activation group
constexpr int kRows = 8;        // input rows per register block
constexpr int64_t kAhead = 2;   // column blocks ahead prefetched

// The activations of x made int8 per row and group of 32: codes [M][K], scales and exact sums [M][K / 32].
struct Acts {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, Acts& a) {
  const int64_t G = K / kGroup;
  a.q.resize(M * K);
  a.d.resize(M * G);
  a.sum.resize(M * G);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const T* p = x + r * K + g * kGroup;
        const __m512 lo = load16(p), hi = load16(p + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(lo, abs_mask), _mm512_and_ps(hi, abs_mask)));
        a.sum[r * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        // IEEE divisions by builtin (DIVSS), which -ffast-math leaves alone: as a plain `/` it became a
        // reciprocal product whose last bit differed, and a tie at .5 rounded the other way than in
        // quant_int4.quantize_activations (the tests' reference).
        const __m128 m = _mm_set_ss(amax), levels = _mm_set_ss(127.0f);
        a.d[r * G + g] = _mm_cvtss_f32(_mm_div_ss(m, levels));
        __m512 inv = _mm512_set1_ps(amax > 0.0f ? _mm_cvtss_f32(_mm_div_ss(levels, m)) : 0.0f);
        __asm__("" : "+v"(inv));  // and no folding of 127 / amax into the products
        // Nearest, ties to even (the default rounding mode); |x| * 127 / amax <= 127, so no saturation.
        int8_t* q = a.q.data() + r * K + g * kGroup;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(lo, inv))));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                         _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(hi, inv))));
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

// Rows r0 .. r0 + R of the activations against one column block: `w` its unpacked codes ([K / 4][16][4] u8),
// `sc` its (scale, min) vectors per group ([K / 32][2][16]); y's 16 columns at `y` (row stride N).
template <int R, typename T>
void block(const uint8_t* w, const float* sc, const Acts& a, int64_t r0, int64_t K, T* y, int64_t N,
           const float* bias) {
  const int64_t G = K / kGroup;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512i isum[R];
    for (int i = 0; i < R; ++i) isum[i] = _mm512_setzero_si512();
    const uint8_t* wg = w + g * 8 * 64;
    for (int t = 0; t < 8; ++t) {
      const __m512i wv = _mm512_loadu_si512(wg + t * 64);
      for (int i = 0; i < R; ++i) {
        const int32_t xq = *reinterpret_cast<const int32_t*>(a.q.data() + (r0 + i) * K + g * kGroup + 4 * t);
        isum[i] = _mm512_dpbusd_epi32(isum[i], wv, _mm512_set1_epi32(xq));
      }
    }
    const __m512 scale = _mm512_loadu_ps(sc + g * 32), mn = _mm512_loadu_ps(sc + g * 32 + 16);
    for (int i = 0; i < R; ++i) {
      const int64_t ag = (r0 + i) * G + g;
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[i]), _mm512_mul_ps(scale, _mm512_set1_ps(a.d[ag])), acc[i]);
      acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.sum[ag]), acc[i]);
    }
  }
  const __m512 b = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias);
  for (int i = 0; i < R; ++i) store16(y + (r0 + i) * N, _mm512_add_ps(acc[i], b));
}

template <typename T>
void run(const Acts& a, const uint8_t* codes, const float* scales, const float* bias, T* y, int64_t M, int64_t K,
         int64_t N) {
  const int64_t blocks = N / kCols, block_bytes = K / 2 * kCols, block_scales = K / kGroup * 2 * kCols;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint8_t> w(K / 4 * 64);
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t cb = b0; cb < b1; ++cb) {
      const uint8_t* src = codes + cb * block_bytes;
      // The block kAhead on into L2 (its codes, K / 8 lines, and scales, K / 16), one or two lines per step
      // of the unpacking: left to the hardware prefetcher, a step's linears at 16 rows with the weights from
      // memory took 11.1 ms against 7.3 in cache; with it 9.1-10.4 (bundled model's shapes x 30 layers,
      // 2 threads, Zen 4 EPYC, a noisy hour).
      const bool pf = cb + kAhead < b1;
      const char* pf_codes = reinterpret_cast<const char*>(codes + (cb + kAhead) * block_bytes);
      const char* pf_scales = reinterpret_cast<const char*>(scales + (cb + kAhead) * block_scales);
      for (int64_t o = 0; o < K / 8; ++o) {  // 8 inputs of 16 columns -> inputs 0-3, then 4-7, as u8
        if (pf) {
          _mm_prefetch(pf_codes + o * 64, _MM_HINT_T1);
          if (o < K / 16) _mm_prefetch(pf_scales + o * 64, _MM_HINT_T1);
        }
        const __m512i v = _mm512_loadu_si512(src + o * 64);
        _mm512_storeu_si512(w.data() + (2 * o) * 64, _mm512_and_si512(v, low));
        _mm512_storeu_si512(w.data() + (2 * o + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
      }
      const float* sc = scales + cb * block_scales;
      const float* bb = bias == nullptr ? nullptr : bias + cb * kCols;
      T* yb = y + cb * kCols;
      int64_t r0 = 0;
      for (; r0 + kRows <= M; r0 += kRows) block<kRows>(w.data(), sc, a, r0, K, yb, N, bb);
      switch (M - r0) {
        case 7: block<7>(w.data(), sc, a, r0, K, yb, N, bb); break;
        case 6: block<6>(w.data(), sc, a, r0, K, yb, N, bb); break;
        case 5: block<5>(w.data(), sc, a, r0, K, yb, N, bb); break;
        case 4: block<4>(w.data(), sc, a, r0, K, yb, N, bb); break;
        case 3: block<3>(w.data(), sc, a, r0, K, yb, N, bb); break;
        case 2: block<2>(w.data(), sc, a, r0, K, yb, N, bb); break;
        case 1: block<1>(w.data(), sc, a, r0, K, yb, N, bb); break;
        default: break;
      }
    }
  });
}

// x [M, K] (bf16 or fp32) @ the int4 weight in tile order: codes uint8 [N, K / 2], scales float32 [N, K / 32, 2]
// (quant_int4.to_tiles); bias float32 [N] or none; y in x's dtype.
at::Tensor linear_int4_tiles(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && codes.dim() == 2 && x_in.size(1) == 2 * codes.size(1), "x [M, K], codes [N, K / 2]");
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat, "x must be bfloat16 or float32");
  const int64_t M = x_in.size(0), K = x_in.size(1), N = codes.size(0);
  TORCH_CHECK(K % 64 == 0 && N % kCols == 0, "K must be a multiple of 64 and N of 16");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * K / kGroup * 2,
              "scales must be float32 [N, K / 32, 2] in tile order");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N, "bias must be float32 [N]");
  const auto x = x_in.contiguous();
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  Acts a;
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const auto go = [&](const auto* xp, auto* yp) {
    quantize_rows(xp, M, K, a);
    run(a, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), bp, yp, M, K, N);
  };
  if (x.scalar_type() == at::kFloat)
    go(x.data_ptr<float>(), y.data_ptr<float>());
  else
    go(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_neuron, m) {
  m.def("linear_int4_tiles(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_neuron, CPU, m) { m.impl("linear_int4_tiles", &linear_int4_tiles); }

#endif  // AVX512-VNNI
