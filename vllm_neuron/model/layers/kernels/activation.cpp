// The gated MLP's activation, silu(gate) * up, from the gate_up projection's bf16 output in one pass.
//
// inductor's fused kernel for it calls Sleef's exp and divides: ~36 us a call for 32 rows of the bundled
// model's 1,536 (about 3 cycles an element), single-threaded below inductor's chunk size, 30 calls a step:
// 0.7-1.0 ms of a ~13 ms prefill_s32 step (2 cores, AMD EPYC Zen 5, 2026-12-04). Here sigmoid comes from
// exp_nonpositive (online_softmax.h, relative error ~2e-7) of -|x|, which never overflows, in a loop the
// compiler vectorizes; the product is rounded to bf16 once, as torch's bf16 silu * up rounds it (the
// two differ at most where the fp32 values straddle a rounding boundary).
#include <ATen/Parallel.h>
#include "op_table.h"
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "online_softmax.h"

namespace {

// Elements a thread takes at least: below this a fork and join costs more than the loop (~0.1 ns an element).
constexpr int64_t kGrainElems = 1 << 14;

#pragma omp declare simd
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));  // exp(-|x|), in (0, 1]
  const float r = 1.f / (1.f + e);
  return x * (x >= 0.f ? r : e * r);
}

// Widening and rounding as torch's bf16 does them (c10's inline bit operations, which the loop vectorizes).
void silu_rows(const uint16_t* h, uint16_t* out, int64_t rows, int64_t inter) {
  using c10::detail::f32_from_bits;
  using c10::detail::round_to_nearest_even;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* gate = h + r * 2 * inter;
    const uint16_t* up = gate + inter;
    uint16_t* o = out + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i)
      o[i] = round_to_nearest_even(silu(f32_from_bits(gate[i])) * f32_from_bits(up[i]));
  }
}

}  // namespace

// h [..., 2I] (gate then up, the gate_up projection's layout) -> [..., I].
at::Tensor vn_ops::silu_and_mul(const at::Tensor& h) {
  TORCH_CHECK(h.scalar_type() == at::kBFloat16, "silu_and_mul takes bf16, got ", h.scalar_type());
  TORCH_CHECK(h.dim() >= 1 && h.size(-1) % 2 == 0, "silu_and_mul needs an even last dimension (gate then up)");
  const auto x = h.contiguous();
  const int64_t inter = x.size(-1) / 2, rows = inter == 0 ? 0 : x.numel() / (2 * inter);
  auto sizes = x.sizes().vec();
  sizes.back() = inter;
  auto out = vn_ops::empty(sizes, x.options());
  if (rows == 0) return out;
  const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t grain = std::max<int64_t>(1, kGrainElems / inter);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    silu_rows(src + r0 * 2 * inter, dst + r0 * inter, r1 - r0, inter);
  });
  return out;
}
