// int4 weights against int8 activations (W4A8) by VPDPBUSD outer products: y[M, N] = x[M, K] @ W^T (+ bias).
//
// The band kernel (linear_quant.cpp) widens int4 bands to bf16 and runs VDPBF16PS: 32 products per
// instruction, so from a few rows on an int4 step costs a bf16 step plus the widening. VPDPBUSD multiplies
// 64 u8 x s8 pairs per instruction, and a 4-bit code is a u8 as it is; the activations are made int8 per row
// and per group of 32 inputs (scale max|x| / 127, the group's exact fp32 sum kept beside it), as llama.cpp's
// Q8 activations and OpenVINO's dynamic quantization (group 32) do. A group of one output column then sums
// exactly in int32, and w = q * scale + min = (q - 8) * scale + (min + 8 * scale) gives
//   sum_k w_k x_k ~= scale * d_x * (sum_k q_k qx_k - 8 * sum_k qx_k) + (min + 8 * scale) * sum_k x_k:
// the rounding of the activations meets the centred codes q - 8, while the products stay u8 x s8. With the
// codes 0..15 as they are its errors summed over weights all of one sign: the bundled model's perplexity on
// this repository's docs was +2.0% over the unquantized model's, centred +0.4% (int4 alone +0.03%;
// benchmarks/int8_activations.py). A subtraction, a conversion, a multiply and two FMAs per group, row and
// 16 columns against 8 VPDPBUSD: 13 instructions per 512 products where bf16 takes 16 (and W8A8 11: its one
// scale per column is applied once at the end).
//
// Weights come in tile order (quant_int4.to_tiles): per 16 output columns, per 8 inputs, 64 bytes, the 4
// bytes of column c holding its codes for inputs 0-3 (low nibbles) and 4-7 (high nibbles), so one AND and
// one shift give two u8 operands of 16 columns x 4 inputs; the (scale, min + 8 * scale) pairs per 16 columns
// and group as two vectors of 16 floats. A thread takes a contiguous range of column blocks, unpacks each block's
// codes once into an L1 buffer, and runs every row block of up to 8 rows against it (8 x 16 int32 and 8 x 16
// fp32 sums in registers).

#include <type_traits>
#include <vector>

#include "op_isa.h"

#ifdef VN_OPS_INT_TILES
#include "op_table.h"
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "int8_acts.h"

namespace {

using vn_acts::Acts;
using vn_acts::kGroup;
using vn_acts::store16;

constexpr int64_t kCols = 16;   // output columns per block (one zmm of sums)
constexpr int64_t kAhead = 2;   // column blocks ahead prefetched

// Rows r0 .. r0 + R of the activations against one column block: `w` its unpacked codes ([K / 4][16][4] u8),
// `sc` its (scale, min + 8 * scale) vectors per group ([K / 32][2][16]); y's 16 columns at `y` (row stride N).
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
      const __m512i centred = _mm512_sub_epi32(isum[i], _mm512_set1_epi32(a.qsum8[ag]));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(centred), _mm512_mul_ps(scale, _mm512_set1_ps(a.d[ag])), acc[i]);
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
      vn_acts::row_blocks(M, [&](auto rows, int64_t r0) {
        block<decltype(rows)::value>(w.data(), sc, a, r0, K, yb, N, bb);
      });
    }
  });
}

}  // namespace

// x [M, K] (bf16 or fp32) @ the int4 weight in tile order: codes uint8 [N, K / 2], scales float32 [N, K / 32, 2]
// (quant_int4.to_tiles); bias float32 [N] or none; y in x's dtype.
at::Tensor vn_ops::linear_int4_tiles(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                                     const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(codes.dim() == 2 && x_in.size(-1) == 2 * codes.size(1), "x [M, K], codes [N, K / 2]");
  const int64_t K = x_in.size(-1), N = codes.size(0);
  TORCH_CHECK(K % 64 == 0 && N % kCols == 0, "K must be a multiple of 64 and N of 16");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be contiguous uint8");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == N * K / kGroup * 2,
              "scales must be float32 [N, K / 32, 2] in tile order");
  return vn_acts::with_int8_rows(x_in, N, bias, false, [&](const Acts& a, auto* yp) {
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    run(a, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), bp, yp, a.q.size() / K, K, N);
  });
}

#endif  // AVX512-VNNI
