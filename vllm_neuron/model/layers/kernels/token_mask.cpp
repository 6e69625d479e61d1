// The greedy end of a step on the logits as the model returns them (bf16 or fp32), without widened copies.
//
// A graph's sampler took three passes over the [rows, vocab] logits: widening to fp32, a copy that a
// torch.cond branch must make when no row is constrained (a branch may not return its input), and inductor's
// argmax (index-value pairs combined lane by lane). At 16 rows of the bundled model's 49,152 tokens that was
// 0.3-0.45 ms of a ~10 ms decode_b16 step (2 cores, AMD EPYC Zen 5, 2026-12-04). Here the grammar mask is
// applied in place, touching only the 32-token words that forbid something (none in an unconstrained batch:
// one read of the bitmask), and the argmax is a max pass and a find-first pass, both plain vector loops.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "cache_elems.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "simd.h"
#define VN_TOKEN_MASK_SIMD
#endif

namespace {

template <typename T>
void mask_rows(T* x, const int32_t* bits, int64_t rows, int64_t vocab, int64_t words) {
  const T neg_inf = static_cast<T>(-std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t* wr = bits + r * words;
    T* xr = x + r * vocab;
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t word = static_cast<uint32_t>(wr[w]);
      if (word == 0xFFFFFFFFu) continue;
      const int64_t end = std::min<int64_t>(32, vocab - 32 * w);
      for (int64_t j = 0; j < end; ++j)
        if (!((word >> j) & 1u)) xr[32 * w + j] = neg_inf;
    }
  }
}

// The first index of the value `mx` (of a NaN when `nan`) from `i` on: the find-first pass after the max.
template <typename T>
int64_t first_of(const T* x, int64_t i, int64_t n, float mx, bool nan) {
  for (; i < n; ++i) {
    const float v = to_f(x[i]);
    if (nan ? v != v : v == mx) return i;
  }
  return 0;  // not reached: mx is a value of the row (or a NaN was seen)
}

// torch.argmax's answer: the first index of the largest value, a NaN counting as larger than everything.
// Scalar form (generic builds): eight running maxima, as one compare-and-select chain is latency-bound.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  constexpr int kLanes = 8;
  float lane[kLanes];
  std::fill(lane, lane + kLanes, -std::numeric_limits<float>::infinity());
  bool nan = false;
  const int64_t body = n / kLanes * kLanes;
  for (int64_t i = 0; i < body; i += kLanes)
    for (int j = 0; j < kLanes; ++j) {
      const float v = to_f(x[i + j]);
      nan |= v != v;
      lane[j] = v > lane[j] ? v : lane[j];
    }
  float mx = *std::max_element(lane, lane + kLanes);
  for (int64_t i = body; i < n; ++i) {
    const float v = to_f(x[i]);
    nan |= v != v;
    mx = v > mx ? v : mx;
  }
  return first_of(x, 0, n, mx, nan);
}

#ifdef VN_TOKEN_MASK_SIMD
// In vector registers (the scalar loops do not vectorize, a NaN-exact select: 1.2 ms for 16 rows x 49,152 bf16,
// against ~23 us here).
using vn_simd::Vec;
inline Vec::R load(const float* x) { return Vec::load(x); }
inline Vec::R load(const c10::BFloat16* x) { return Vec::load(reinterpret_cast<const uint16_t*>(x)); }

template <typename T>
int64_t argmax_row_simd(const T* x, int64_t n) {
  const int64_t body = n / Vec::W * Vec::W;
  Vec::R vmx = Vec::set1(-std::numeric_limits<float>::infinity());
  uint32_t nan = 0;
  for (int64_t i = 0; i < body; i += Vec::W) {
    const Vec::R v = load(x + i);
    nan |= Vec::nan_lanes(v);
    vmx = Vec::max(vmx, v);
  }
  float mx = Vec::reduce_max(vmx);
  for (int64_t i = body; i < n; ++i) {
    const float v = to_f(x[i]);
    nan |= v != v;
    mx = v > mx ? v : mx;
  }
  const Vec::R target = Vec::set1(mx);
  for (int64_t i = 0; i < body; i += Vec::W) {
    const Vec::R v = load(x + i);
    const uint32_t hit = nan ? Vec::nan_lanes(v) : Vec::eq_lanes(v, target);
    if (hit) return i + __builtin_ctz(hit);
  }
  return first_of(x, body, n, mx, nan != 0);
}

inline int64_t argmax_row(const float* x, int64_t n) { return argmax_row_simd(x, n); }
inline int64_t argmax_row(const c10::BFloat16* x, int64_t n) { return argmax_row_simd(x, n); }
#endif

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be a contiguous [rows, vocab] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous [rows, ceil(vocab / 32)] int32 tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(bitmask.size(0) == rows && words == (vocab + 31) / 32,
              "bitmask must be [rows, ceil(vocab / 32)] for logits [rows, vocab]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "apply_token_bitmask_", [&] {
    mask_rows(logits.data_ptr<scalar_t>(), bitmask.data_ptr<int32_t>(), rows, vocab, words);
  });
}

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, vocab] with vocab > 0");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "greedy_argmax", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(p + r * vocab, vocab);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_neuron, m) {
  m.def("apply_token_bitmask_(Tensor(a!) logits, Tensor bitmask) -> ()");
  m.def("greedy_argmax(Tensor logits) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_neuron, CPU, m) {
  m.impl("apply_token_bitmask_", &apply_token_bitmask_);
  m.impl("greedy_argmax", &greedy_argmax);
}
