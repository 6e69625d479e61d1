// The argument checks both tile-order linears share (linear_amx.cpp, linear_dot_tiles.cpp): x [M, K] bf16, the
// weight [N, K] packed in tile order (packed_weights.pack_tiles), an optional bf16 bias [N].
#pragma once
#include <ATen/core/Tensor.h>

inline void check_tile_linear_args(const at::Tensor& x, const at::Tensor& packed,
                                   const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bf16");
  TORCH_CHECK(x.size(1) % 32 == 0 && N % 16 == 0, "K must be a multiple of 32 and N of 16");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.numel() == N * x.size(1),
              "packed must hold the [N, K] weight in tile order (packed_weights.pack_tiles)");
  if (bias.has_value())
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "bias must be [N] bf16");
}
