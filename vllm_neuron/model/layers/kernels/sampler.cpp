// The sampler's end of a step on the logits as the model returns them (bf16 or fp32), without widened copies:
// the grammar mask, the greedy argmax and the seeded draw (in_graph_sampler.py's algorithm, row by row).
//
// A graph's sampler took three passes over the [rows, vocab] logits: widening to fp32, a copy that a
// torch.cond branch must make when no row is constrained (a branch may not return its input), and inductor's
// argmax (index-value pairs combined lane by lane). At 16 rows of the bundled model's 49,152 tokens that was
// 0.3-0.45 ms of a ~10 ms decode_b16 step (2 cores, AMD EPYC Zen 5, 2026-12-04). Here the grammar mask is
// applied in place, touching only the 32-token words that forbid something (none in an unconstrained batch:
// one read of the bitmask), and the argmax is a max pass and a find-first pass, both plain vector loops.
//
// The seeded draw (temperature, top-k, top-p, inverse CDF), with MRv2's per-slot parameter gathers, counter hash
// and token write-back, was inductor's code in every bucket's graph: two of a decode graph's 8 generated kernels,
// each its own codegen and g++ run. As ops the bundled model's 8 graphs compile in 68-71 s instead of 94-100 s
// (2-core AMD EPYC Zen 4, 2026-12-07). The draw's arithmetic is the torch sampler's: the same
// divisions (this file is built without reciprocal math), logsumexp as max + log(sum exp), the top-p mass as
// cumsum - p over the k best values, and the CDF walked in token-id order; only the exp and the order of the
// sums differ (~1e-7 relative), so a token differs only where the draw falls that close to a CDF step.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include "op_table.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "cache_elems.h"
#include "online_softmax.h"

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

}  // namespace

void vn_ops::apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask) {
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

at::Tensor vn_ops::greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, vocab] with vocab > 0");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto out = vn_ops::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "greedy_argmax", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(p + r * vocab, vocab);
    });
  });
  return out;
}

namespace {

// ---- The seeded draw ----

constexpr float kGreedyEps = 1e-5f;  // in_graph_sampler.py's _GREEDY_EPS: below it a row is greedy

// exp(x) for x <= 0, and exactly 0 below -87 (exp_nonpositive clamps there to ~1.6e-38: a -inf logit, a token
// the grammar forbids, must keep no mass at all).
#pragma omp declare simd
inline float exp_or_zero(float x) { return x < -87.f ? 0.f : exp_nonpositive(x); }

// The k largest of s[0, n), largest first, into out[0, k) (torch.topk's values). A min-heap of k values: past
// the first blocks few values beat its smallest, so most of a row is a max of 16 and one compare.
void top_values(const float* s, int64_t n, int64_t k, float* out) {
  const std::greater<float> gt;
  std::copy(s, s + k, out);
  std::make_heap(out, out + k, gt);  // out[0]: the smallest held
  auto offer = [&](float v) {
    if (v > out[0]) {
      std::pop_heap(out, out + k, gt);
      out[k - 1] = v;
      std::push_heap(out, out + k, gt);
    }
  };
  constexpr int kBlock = 16;
  int64_t i = k;
  for (; i + kBlock <= n; i += kBlock) {
    float mx = s[i];
    for (int j = 1; j < kBlock; ++j) mx = s[i + j] > mx ? s[i + j] : mx;
    if (mx > out[0])
      for (int j = 0; j < kBlock; ++j) offer(s[i + j]);
  }
  for (; i < n; ++i) offer(s[i]);
  std::sort_heap(out, out + k, gt);  // by `gt`: largest first
}

// The logit threshold of a truncating row's kept set (in_graph_sampler.py's _kept_set): the top-k values, the
// top-p prefix of them by mass (over the whole vocabulary's logsumexp `lse` when top-k is off), its last value.
float kept_threshold(const float* s, int64_t V, int64_t top_k, float top_p, float lse, int64_t max_top_k,
                     int64_t width, float* top) {
  const int64_t k = std::min(width, V);
  top_values(s, V, k, top);
  const int64_t k_eff = top_k <= 0 ? std::min(max_top_k, k) : std::min(top_k, k);
  float norm = lse;
  if (top_k > 0 && k_eff > 0) {
    float sum = 0.f;
    for (int64_t i = 0; i < k_eff; ++i) sum += std::exp(top[i] - top[0]);
    norm = top[0] + std::log(sum);
  }
  float cum = 0.f;
  int64_t kept = 0;
  for (int64_t i = 0; i < k_eff; ++i) {
    const float p = std::exp(top[i] - norm);
    const float before = (cum + p) - p;  // torch's cumsum - probs
    cum += p;
    kept += i == 0 || top_p >= 1.f || before < top_p;
  }
  return top[std::max<int64_t>(kept - 1, 0)];
}

// One random row: the scaled logits into s, the kept set's probabilities in place, then the inverse CDF at u in
// token-id order (a sum per block of 64 finds the block, a walk inside it the token), never past the last token
// with mass. `sums` holds ceil(V / 64) floats, `top` width.
template <typename T>
int64_t draw_row(const T* x, int64_t V, float temp, int64_t top_k, float top_p, float u, int64_t max_top_k,
                 int64_t width, float* s, float* top, float* sums) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) {
    s[v] = to_f(x[v]) / temp;
    mx = s[v] > mx ? s[v] : mx;
  }
  if (!(mx > -std::numeric_limits<float>::infinity())) return 0;  // nothing allowed (or NaN): no distribution
  float total_exp = 0.f;
  for (int64_t v = 0; v < V; ++v) total_exp += exp_or_zero(s[v] - mx);
  const float lse = mx + std::log(total_exp);
  const float threshold = top_k > 0 || top_p < 1.f
                              ? kept_threshold(s, V, top_k, top_p, lse, max_top_k, width, top)
                              : -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < V; ++v) s[v] = s[v] >= threshold ? exp_or_zero(s[v] - lse) : 0.f;

  constexpr int64_t kBlock = 64;
  const int64_t blocks = (V + kBlock - 1) / kBlock;
  float total = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    float sum = 0.f;
    for (int64_t v = b * kBlock; v < std::min(V, (b + 1) * kBlock); ++v) sum += s[v];
    sums[b] = sum;
    total += sum;
  }
  const float target = u * total;
  int64_t choice = V;  // torch's count of CDF entries <= target
  float run = 0.f;
  for (int64_t b = 0; b < blocks && choice == V; ++b) {
    if (!(run + sums[b] > target)) {
      run += sums[b];
      continue;
    }
    for (int64_t v = b * kBlock; v < std::min(V, (b + 1) * kBlock); ++v) {
      run += s[v];
      if (run > target) {
        choice = v;
        break;
      }
    }
  }
  int64_t last = V - 1;
  while (last > 0 && !(s[last] > 0.f)) --last;
  return std::min(choice, last);
}

// A row's sampling parameters: temperature, top-k, top-p, and its uniform number.
struct RowParams {
  float temp;
  int64_t top_k;
  float top_p;
  float u;
};

// in_graph_sampler.py's counter_uniform, bit for bit: the same 32-bit mixes in 64-bit unsigned arithmetic (a
// 32-bit value times a multiplier below 2^31 stays below 2^63), the top 24 bits of the hash as the fraction.
inline uint64_t mix32(uint64_t x) {
  constexpr uint64_t kM32 = 0xFFFFFFFFull;
  x ^= x >> 16;
  x = (x * 0x7FEB352Dull) & kM32;
  x ^= x >> 15;
  x = (x * 0x6A09E667ull) & kM32;
  return x ^ (x >> 16);
}
inline float counter_uniform(int64_t seed, int64_t position) {
  constexpr uint64_t kM32 = 0xFFFFFFFFull;
  const uint64_t h = mix32((static_cast<uint64_t>(seed) & kM32) ^ mix32((static_cast<uint64_t>(position) & kM32) ^ 0x5BD1E995ull));
  return static_cast<float>(h >> 8) * (1.0f / (1 << 24));
}

// Every row of logits [rows, vocab] sampled with params(r): greedy rows by the argmax, the others drawn.
template <typename Params>
at::Tensor sample_each_row(const at::Tensor& logits, int64_t max_top_k, int64_t width, const Params& params) {
  TORCH_CHECK(max_top_k > 0 && width > 0, "max_top_k and width must be positive");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  auto out = vn_ops::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t k = std::min(width, vocab), blocks = (vocab + 63) / 64;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "sample_rows", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
      // Per thread, kept: a fresh ~200 KB buffer each step would be mapped and unmapped by malloc.
      thread_local std::vector<float> buf;
      if (buf.size() < static_cast<size_t>(vocab + k + blocks)) buf.resize(vocab + k + blocks);
      for (int64_t r = r0; r < r1; ++r) {
        const RowParams q = params(r);
        o[r] = q.temp < kGreedyEps ? argmax_row(p + r * vocab, vocab)
                                   : draw_row(p + r * vocab, vocab, q.temp, q.top_k, q.top_p, q.u, max_top_k, width,
                                              buf.data(), buf.data() + vocab, buf.data() + vocab + k);
      }
    });
  });
  return out;
}

void check_logits(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits must be [rows, vocab] with vocab > 0");
}

}  // namespace

at::Tensor vn_ops::sample_rows(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                               const at::Tensor& top_p, const at::Tensor& uniform, int64_t max_top_k, int64_t width) {
  check_logits(logits);
  const int64_t rows = logits.size(0);
  for (const at::Tensor* t : {&temperature, &top_k, &top_p, &uniform})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows, "temperature, top_k, top_p and uniform must be [rows]");
  const auto temp = temperature.to(at::kFloat).contiguous(), tp = top_p.to(at::kFloat).contiguous(),
             un = uniform.to(at::kFloat).contiguous();
  const auto tk = top_k.to(at::kLong).contiguous();
  const float *pt = temp.data_ptr<float>(), *pp = tp.data_ptr<float>(), *pu = un.data_ptr<float>();
  const int64_t* pk = tk.data_ptr<int64_t>();
  return sample_each_row(logits, max_top_k, width, [&](int64_t r) { return RowParams{pt[r], pk[r], pp[r], pu[r]}; });
}

// Model Runner V2's form: row r's parameters are those of batch slot slots[r] (per-slot state tensors), its number
// counter_uniform(seed[slot], positions[r]): no gathers or hashing left for the graph to generate code for.
at::Tensor vn_ops::sample_slots(const at::Tensor& logits, const at::Tensor& slots, const at::Tensor& positions,
                                const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                                const at::Tensor& seed, int64_t max_top_k, int64_t width) {
  check_logits(logits);
  const int64_t rows = logits.size(0), n = temperature.size(0);
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == rows && positions.dim() == 1 && positions.size(0) == rows,
              "slots and positions must be [rows]");
  for (const at::Tensor* t : {&temperature, &top_k, &top_p, &seed})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == n, "temperature, top_k, top_p and seed must be [slots]");
  const auto sl = slots.to(at::kLong).contiguous(), pos = positions.to(at::kLong).contiguous(),
             tk = top_k.to(at::kLong).contiguous(), sd = seed.to(at::kLong).contiguous();
  const auto temp = temperature.to(at::kFloat).contiguous(), tp = top_p.to(at::kFloat).contiguous();
  const int64_t *ps = sl.data_ptr<int64_t>(), *ppos = pos.data_ptr<int64_t>(), *pk = tk.data_ptr<int64_t>(),
                *psd = sd.data_ptr<int64_t>();
  const float *pt = temp.data_ptr<float>(), *pp = tp.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(ps[r] >= 0 && ps[r] < n, "slot ", ps[r], " out of range [0, ", n, ")");
  return sample_each_row(logits, max_top_k, width, [&](int64_t r) {
    const int64_t s = ps[r];
    return RowParams{pt[s], pk[s], pp[s], counter_uniform(psd[s], ppos[r])};
  });
}

// Model Runner V2's write-back: each sampled row's token and next position into its slot, in place; the dummy slot
// (the last one, where padding rows point) is kept at (token 0, position 0) whatever its rows sampled.
void vn_ops::store_token_state_(at::Tensor& last_token, at::Tensor& position, const at::Tensor& slots,
                                const at::Tensor& tokens, const at::Tensor& next_pos) {
  TORCH_CHECK(last_token.dim() == 1 && last_token.scalar_type() == at::kLong && last_token.is_contiguous() &&
                  position.dim() == 1 && position.scalar_type() == at::kLong && position.is_contiguous() &&
                  position.size(0) == last_token.size(0),
              "last_token and position must be contiguous int64 [slots]");
  const int64_t n = last_token.size(0), rows = slots.size(0);
  TORCH_CHECK(slots.dim() == 1 && tokens.dim() == 1 && next_pos.dim() == 1 && tokens.size(0) == rows &&
                  next_pos.size(0) == rows,
              "slots, tokens and next_pos must be [rows]");
  const auto sl = slots.to(at::kLong).contiguous(), tk = tokens.to(at::kLong).contiguous(),
             np = next_pos.to(at::kLong).contiguous();
  const int64_t *ps = sl.data_ptr<int64_t>(), *pt = tk.data_ptr<int64_t>(), *pn = np.data_ptr<int64_t>();
  int64_t *lt = last_token.data_ptr<int64_t>(), *po = position.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = ps[r];
    TORCH_CHECK(s >= 0 && s < n, "slot ", s, " out of range [0, ", n, ")");
    const bool dummy = s == n - 1;
    lt[s] = dummy ? 0 : pt[r];
    po[s] = dummy ? 0 : pn[r];
  }
}


