// The library's ops as C++ functions: defined in the sources, registered with torch in op_registry.cpp (their
// schemas are there), present where op_isa.h says.
//
// Only op_registry.cpp includes torch/library.h and ATen/ops/*.h, and linear_tile_copies.cpp the dispatcher (its
// lookup): parsing those cost every source ~3 s more than ATen/core/Tensor.h alone, a third of a cold build.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <string>

#include "op_isa.h"

namespace vn_ops {

// at::empty / at::zeros, out of line (their header is one of the costly ones).
at::Tensor empty(c10::IntArrayRef sizes, const at::TensorOptions& options);
at::Tensor zeros(c10::IntArrayRef sizes, const at::TensorOptions& options);

// paged_attention.cpp
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& positions,
                           double scale, int64_t block_size, const c10::optional<at::Tensor>& sinks, int64_t window);
at::Tensor paged_attention_fp8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& block_tables, const at::Tensor& query_start,
                               const at::Tensor& positions, double scale, int64_t block_size,
                               const at::Tensor& k_scale, const at::Tensor& v_scale,
                               const c10::optional<at::Tensor>& sinks, int64_t window);
int64_t bf16_rows_path(int64_t head_dim);

// sampler.cpp
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask);
at::Tensor greedy_argmax(const at::Tensor& logits);
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                       const at::Tensor& top_p, const at::Tensor& uniform, int64_t max_top_k, int64_t width);
at::Tensor sample_slots(const at::Tensor& logits, const at::Tensor& slots, const at::Tensor& positions,
                        const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                        const at::Tensor& seed, int64_t max_top_k, int64_t width);
void store_token_state_(at::Tensor& last_token, at::Tensor& position, const at::Tensor& slots,
                        const at::Tensor& tokens, const at::Tensor& next_pos);

// activation.cpp
at::Tensor silu_and_mul(const at::Tensor& h);

// linear_tile_copies.cpp
void register_tile_copy(const at::Tensor& w, const at::Tensor& tiles, const std::string& kernel, int64_t rows);
void forget_tile_copy(int64_t address);
at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias);

// lora.cpp
at::Tensor lora_delta(const at::Tensor& x, const at::Tensor& slot, const at::Tensor& a, const at::Tensor& b_t);

#ifdef VN_OPS_LINEAR_BF16
// linear_bf16.cpp
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w);
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w);
#endif

#ifdef VN_OPS_LINEAR_QUANT
// linear_quant.cpp
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);
at::Tensor linear_int4(const at::Tensor& x, const at::Tensor& q, const at::Tensor& sm);
// quant_unpack.cpp
at::Tensor unpack_int8(const at::Tensor& q, at::ScalarType dtype);
at::Tensor unpack_int4(const at::Tensor& q, const at::Tensor& sm, at::ScalarType dtype);
#endif

#ifdef VN_OPS_QUANT_PATH
at::Tensor linear_quant_path(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                             c10::string_view path);
#endif

#ifdef VN_OPS_DOT_TILES
at::Tensor linear_dot_tiles(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                            int64_t N);
#endif

#ifdef VN_OPS_INT_TILES
at::Tensor linear_int4_tiles(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales,
                             const c10::optional<at::Tensor>& bias);
at::Tensor linear_int8_tiles(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& corr,
                             const at::Tensor& scale, const c10::optional<at::Tensor>& bias);
#endif

#ifdef VN_OPS_INT8_AMX
at::Tensor linear_int8_amx(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& corr,
                           const at::Tensor& scale, const c10::optional<at::Tensor>& bias);
#endif

#ifdef VN_OPS_LINEAR_AMX
at::Tensor linear_amx(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                      int64_t N);
#endif

}  // namespace vn_ops
