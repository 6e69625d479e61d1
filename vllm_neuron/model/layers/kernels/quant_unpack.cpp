// int8 / int4 weights put back in row order in a compute dtype, for the prefill-sized inputs that take oneDNN's
// matmul (quant_int8.py / quant_int4.py's `linear` above the kernel rows). Layouts: linear_quant.cpp's comment.
// The ATen headers used, not ATen/ATen.h: parsing all of that doubles the first start's kernel build; and inside
// the CPU-class guard, so that a class without these kernels compiles the file in no time.

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512BF16__)
#include "int4_table.h"
#endif

// Built with the quantized linears (the same CPU classes); elsewhere callers dequantize in torch.
#include "op_isa.h"

#ifdef VN_OPS_LINEAR_QUANT
#include "op_table.h"
#include <ATen/Parallel.h>

namespace {

constexpr int64_t kBand = 4;  // output rows per band (quant_bands.BAND)

inline void put(float* p, float v) { *p = v; }
inline void put(c10::BFloat16* p, float v) { *p = c10::BFloat16(v); }
inline void put(c10::Half* p, float v) { *p = c10::Half(v); }

// Prefill-sized inputs take oneDNN's matmul on the weight put back in row order in the compute dtype: one
// pass over the quantized bytes, parallel over bands (torch's unbanding is a transpose and a concatenation,
// then a conversion: three passes and three allocations, every linear of every prefill step).
template <typename T, typename F>
at::Tensor unband(int64_t N, int64_t K, at::ScalarType dtype, F&& rows_of_band) {
  auto w = vn_ops::empty({N, K}, at::TensorOptions().dtype(dtype));
  T* wp = w.data_ptr<T>();
  const int64_t bands = (N + kBand - 1) / kBand;
  at::parallel_for(0, bands, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) rows_of_band(b * kBand, std::min(kBand, N - b * kBand), wp);
  });
  return w;
}

// go(T* tag) with T the element type of `dtype` (a null pointer of that type).
template <typename Go>
void by_dtype(at::ScalarType dtype, Go&& go) {
  switch (dtype) {
    case at::kFloat: go(static_cast<float*>(nullptr)); break;
    case at::kBFloat16: go(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: go(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, "dtype must be float32, bfloat16 or float16");
  }
}

template <typename T>
void put_all(T* dst, const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) put(dst + i, v[i]);
}

}  // namespace

// int8: w[n, k] = q (exact in every compute dtype); the per-row scale stays with the matmul's output.
at::Tensor vn_ops::unpack_int8(const at::Tensor& q, at::ScalarType dtype) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous(), "q must be contiguous int8 [N, K]");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(K % 16 == 0, "K must be a multiple of 16");
  const int8_t* qp = q.data_ptr<int8_t>();
  at::Tensor out;
  const auto go = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    out = unband<T>(N, K, dtype, [&](int64_t n0, int64_t rows, T* wp) {
      const int8_t* band = qp + n0 * K;
      float v[16];
      for (int64_t c = 0; c < K / 16; ++c)
        for (int64_t r = 0; r < rows; ++r) {
          const int8_t* src = band + (c * rows + r) * 16;
          for (int i = 0; i < 16; ++i) v[i] = src[i];
          put_all(wp + (n0 + r) * K + c * 16, v, 16);
        }
    });
  };
  by_dtype(dtype, go);
  return out;
}

// int4: w[n, k] = q * scale + min in fp32, then rounded to the compute dtype.
at::Tensor vn_ops::unpack_int4(const at::Tensor& q, const at::Tensor& sm, at::ScalarType dtype) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte && q.is_contiguous(), "q must be contiguous uint8");
  const int64_t N = q.size(0), K = 2 * q.size(1);
  TORCH_CHECK(K % 64 == 0, "K must be a multiple of 64");
  TORCH_CHECK(sm.scalar_type() == at::kFloat && sm.is_contiguous() && sm.numel() == N * (K / 16),
              "scales must be float32 [N, K / 32, 2]");
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = sm.data_ptr<float>();
  at::Tensor out;
  const auto go = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    out = unband<T>(N, K, dtype, [&](int64_t n0, int64_t rows, T* wp) {
      const uint8_t* band = qp + n0 * (K / 2);
      const float* band_sm = sp + n0 * (K / 16);
      float v[64];
      for (int64_t c = 0; c < K / 64; ++c)
        for (int64_t r = 0; r < rows; ++r) {
          const uint8_t* src = band + (c * rows + r) * 32;
          const float* s = band_sm + (c * rows + r) * 4;  // scale, min of the first group, then the second
#if defined(__AVX512BF16__)
          if constexpr (std::is_same_v<T, c10::BFloat16>) {  // by table, as the decode kernel's bands
            vn_int4::superblock_bf16(src, s, reinterpret_cast<uint16_t*>(wp + (n0 + r) * K + c * 64));
            continue;
          }
#endif
          for (int i = 0; i < 32; ++i) {
            v[i] = static_cast<float>(src[i] & 15) * s[0] + s[1];
            v[32 + i] = static_cast<float>(src[i] >> 4) * s[2] + s[3];
          }
          put_all(wp + (n0 + r) * K + c * 64, v, 64);
        }
    });
  };
  by_dtype(dtype, go);
  return out;
}

#endif  // AVX-512 or AVX2 + FMA
