// The library's ops, registered with torch: every schema, and the CPU kernel of each (op_table.h), where
// op_isa.h says the build has it. One translation unit, so that the registration headers are parsed once.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include "op_table.h"

at::Tensor vn_ops::empty(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::empty(sizes, options);
}

at::Tensor vn_ops::zeros(c10::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::zeros(sizes, options);
}

TORCH_LIBRARY(vllm_neuron, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start, "
        "Tensor positions, float scale, int block_size, Tensor? sinks=None, int window=0) -> Tensor");
  m.def("paged_attention_fp8(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor query_start, "
        "Tensor positions, float scale, int block_size, Tensor k_scale, Tensor v_scale, Tensor? sinks=None, "
        "int window=0) -> Tensor");
  m.def("bf16_rows_path(int head_dim) -> int", &vn_ops::bf16_rows_path);
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask) -> ()");
  m.def("greedy_argmax(Tensor logits) -> Tensor");
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor uniform, int max_top_k, "
        "int width) -> Tensor");
  m.def("sample_slots(Tensor logits, Tensor slots, Tensor positions, Tensor temperature, Tensor top_k, Tensor top_p, "
        "Tensor seed, int max_top_k, int width) -> Tensor");
  m.def("store_token_state_(Tensor(a!) last_token, Tensor(b!) position, Tensor slots, Tensor tokens, "
        "Tensor next_pos) -> ()");
  m.def("silu_and_mul(Tensor h) -> Tensor");
  m.def("register_tile_copy(Tensor w, Tensor tiles, str kernel, int rows) -> ()", &vn_ops::register_tile_copy);
  m.def("forget_tile_copy(int address) -> ()", &vn_ops::forget_tile_copy);
  m.def("linear_tiles(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("lora_delta(Tensor x, Tensor slot, Tensor a, Tensor b_t) -> Tensor");
#ifdef VN_OPS_LINEAR_BF16
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor");
#endif
#ifdef VN_OPS_LINEAR_QUANT
  m.def("linear_int8(Tensor x, Tensor q, Tensor scale) -> Tensor");
  m.def("linear_int4(Tensor x, Tensor q, Tensor scales) -> Tensor");
  m.def("unpack_int8(Tensor q, ScalarType dtype) -> Tensor");
  m.def("unpack_int4(Tensor q, Tensor scales, ScalarType dtype) -> Tensor");
#endif
#ifdef VN_OPS_QUANT_PATH
  m.def("linear_quant_path(Tensor x, Tensor q, Tensor scales, str path) -> Tensor");
#endif
#ifdef VN_OPS_DOT_TILES
  m.def("linear_dot_tiles(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
#endif
#ifdef VN_OPS_INT_TILES
  m.def("linear_int4_tiles(Tensor x, Tensor codes, Tensor scales, Tensor? bias) -> Tensor");
  m.def("linear_int8_tiles(Tensor x, Tensor codes, Tensor corr, Tensor scale, Tensor? bias) -> Tensor");
#endif
#ifdef VN_OPS_INT8_AMX
  m.def("linear_int8_amx(Tensor x, Tensor codes, Tensor corr, Tensor scale, Tensor? bias) -> Tensor");
#endif
#ifdef VN_OPS_LINEAR_AMX
  m.def("linear_amx(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
#endif
}

TORCH_LIBRARY_IMPL(vllm_neuron, CPU, m) {
  m.impl("paged_attention", &vn_ops::paged_attention);
  m.impl("paged_attention_fp8", &vn_ops::paged_attention_fp8);
  m.impl("apply_token_bitmask_", &vn_ops::apply_token_bitmask_);
  m.impl("greedy_argmax", &vn_ops::greedy_argmax);
  m.impl("sample_rows", &vn_ops::sample_rows);
  m.impl("sample_slots", &vn_ops::sample_slots);
  m.impl("store_token_state_", &vn_ops::store_token_state_);
  m.impl("silu_and_mul", &vn_ops::silu_and_mul);
  m.impl("linear_tiles", &vn_ops::linear_tiles);
  m.impl("lora_delta", &vn_ops::lora_delta);
#ifdef VN_OPS_LINEAR_BF16
  m.impl("linear_bf16", &vn_ops::linear_bf16);
  m.impl("linear_f32", &vn_ops::linear_f32);
#endif
#ifdef VN_OPS_LINEAR_QUANT
  m.impl("linear_int8", &vn_ops::linear_int8);
  m.impl("linear_int4", &vn_ops::linear_int4);
  m.impl("unpack_int8", &vn_ops::unpack_int8);
  m.impl("unpack_int4", &vn_ops::unpack_int4);
#endif
#ifdef VN_OPS_QUANT_PATH
  m.impl("linear_quant_path", &vn_ops::linear_quant_path);
#endif
#ifdef VN_OPS_DOT_TILES
  m.impl("linear_dot_tiles", &vn_ops::linear_dot_tiles);
#endif
#ifdef VN_OPS_INT_TILES
  m.impl("linear_int4_tiles", &vn_ops::linear_int4_tiles);
  m.impl("linear_int8_tiles", &vn_ops::linear_int8_tiles);
#endif
#ifdef VN_OPS_INT8_AMX
  m.impl("linear_int8_amx", &vn_ops::linear_int8_amx);
#endif
#ifdef VN_OPS_LINEAR_AMX
  m.impl("linear_amx", &vn_ops::linear_amx);
#endif
}
