// Weight-streaming linear for small batches (decode): y[M, N] = x[M, K] @ w[N, K]^T.
//
// At decode sizes a linear layer only has to stream its weights once; oneDNN reaches about half the
// memory bandwidth there. The weights arrive at full speed only as one sequential stream per thread, so
// up to four input rows (batch-1 and small decode steps, bandwidth-bound) each thread walks its own range
// of weight rows one row at a time, front to back (prefetching the row eight on), against all input rows
// held in L1 (not on AMX CPUs, where the bands below measured faster from one row on). From five rows on
// each thread takes bands of four weight rows, read once from memory, and runs them against four input
// rows at a time (16 accumulators in registers; six rows from 17 rows on), the band staying in L1 across
// the row blocks while the band after next is prefetched. One code path per instruction set, chosen when
// the library is built (kernels/__init__.py picks the compiler flags per CPU class):
//   AVX512-BF16: bf16 pairs multiplied and accumulated in fp32 by VDPBF16PS (linear_bf16);
//   AVX-512 / AVX2 + FMA: bf16 weights widened to fp32 by a 16-bit shift (the inputs once per call), then FMA
//   (linear_bf16), and fp32 (linear_f32).
// Elsewhere the ops are not registered and callers use F.linear.
// The ATen headers used, not ATen/ATen.h: parsing all of that doubles the first start's kernel build.

#include <cstring>
#include <type_traits>
#include <vector>

#include "op_isa.h"

#ifdef VN_OPS_LINEAR_BF16
#include "op_table.h"
#include <ATen/Parallel.h>
#include "simd.h"

namespace {

using vn_simd::Vec;
using R = Vec::R;

inline void put(float* p, float v) { *p = v; }
inline void put(uint16_t* p, float v) { *p = c10::BFloat16(v).x; }

// How a step of kStep weights of one row meets the same kStep inputs: widened to fp32 and FMA'd. T is the
// weights' and outputs' type, X the inputs': bf16 weights meet inputs widened to fp32 once per call, so that
// the inner loop widens each weight vector once and no input vector at all (a block of MB input rows had
// widened every input vector again for each of its weight rows: at four rows three in four of the loop's
// widening instructions).
template <typename E, typename XE = E>
struct Widen {
  using T = E;
  using X = XE;
  using L = R;
  static constexpr int kStep = Vec::W;
  static L load(const T* p) { return Vec::load(p); }
  static L load_x(const X* p) { return Vec::load(p); }
  static R madd(R acc, L x, L w) { return Vec::fma(x, w, acc); }
};

#if defined(__AVX512BF16__)
// bf16 pairs multiplied and summed into fp32 lanes in hardware (products exact, as when widened).
struct DotBf16 {
  using T = uint16_t;
  using X = T;
  using L = __m512bh;
  static constexpr int kStep = 32;
  static L load(const T* p) { return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p)); }
  static L load_x(const X* p) { return load(p); }
  static R madd(R acc, L x, L w) { return _mm512_dpbf16_ps(acc, x, w); }
};
using Bf16 = DotBf16;
#else
using Bf16 = Widen<uint16_t, float>;
#endif

// One step of kStep inputs: the NB weight rows' vectors at k against MB input rows into `acc`, while one line of
// each of `npf` weight rows at `pf` is pulled into cache (at each line of K).
template <typename Op, int MB, int NB>
[[gnu::always_inline]] inline void tile_step(R (&acc)[MB][NB], const typename Op::X* x, const typename Op::T* w,
                                             int64_t K, int64_t m0, int64_t n0, int64_t k,
                                             const typename Op::T* pf, int npf) {
  constexpr int64_t kLine = 64 / sizeof(typename Op::T);
  typename Op::L wv[NB];
  for (int j = 0; j < NB; ++j) wv[j] = Op::load(w + (n0 + j) * K + k);
  if (k % kLine == 0)
    for (int j = 0; j < npf; ++j) vn_simd::prefetch(pf + j * K + k, 64);
  for (int i = 0; i < MB; ++i) {
    const auto xv = Op::load_x(x + (m0 + i) * K + k);
    for (int j = 0; j < NB; ++j) acc[i][j] = Op::madd(acc[i][j], xv, wv[j]);
  }
}

// MB input rows (m0..) against NB weight rows (n0..); with S = 2, two sets of partial sums, alternating steps,
// hide the multiply-add latency where MB * NB is small.
// `pf`: `npf` weight rows (row stride K) to pull into cache meanwhile, one 64-byte line of each per line of K.
// The sums are named arrays, each step an inlined function, and the sums stored from a copy: an array of sets
// indexed inside a lambda had GCC keep some sums in memory across the loop (a store-to-load chain each step:
// the four-row loop took twice as long, in every build; the one-row loop carried its second set through the
// stack too).
template <typename Op, int MB, int NB, int S>
void tile(const typename Op::X* x, const typename Op::T* w, typename Op::T* y, int64_t K, int64_t N, int64_t m0,
          int64_t n0, const typename Op::T* pf = nullptr, int npf = 0) {
  static_assert(S == 1 || S == 2, "one or two sets of partial sums");
  using T = typename Op::T;
  constexpr int kStep = Op::kStep;
  R a0[MB][NB], a1[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) a0[i][j] = a1[i][j] = Vec::zero();
  int64_t k = 0;
  if constexpr (S == 2)
    for (; k + 2 * kStep <= K; k += 2 * kStep) {
      tile_step<Op>(a0, x, w, K, m0, n0, k, pf, npf);
      tile_step<Op>(a1, x, w, K, m0, n0, k + kStep, pf, npf);
    }
  for (; k < K; k += kStep) tile_step<Op>(a0, x, w, K, m0, n0, k, pf, npf);
  R sum[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) sum[i][j] = S == 2 ? Vec::add(a0[i][j], a1[i][j]) : a0[i][j];
  vn_simd::store_tile(sum, y, N, m0, n0, nullptr, [](T* p, float v) { put(p, v); });
}

template <typename Op, int MB>
void rows(const typename Op::X* x, const typename Op::T* w, typename Op::T* y, int64_t K, int64_t N) {
  constexpr int S = MB <= 2 ? 2 : 1;
  // The weight row kRowsAhead on is prefetched line by line while this one is read: the hardware prefetcher
  // alone left one step's linears (121 calls, each stream starting cold) at 4.7-6.8 ms for 1 row and 7.0-8.9
  // for 4, against 4.3-6.1 and 4.5-6.2 with 6-8 rows ahead (2 threads, Zen 5, weights from memory, 2026-12-04).
  constexpr int64_t kRowsAhead = 8;
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const bool ahead = n + kRowsAhead < n1;
      tile<Op, MB, 1, S>(x, w, y, K, N, 0, n, ahead ? w + (n + kRowsAhead) * K : nullptr, ahead ? 1 : 0);
    }
  });
}

// NB weight rows (n0..) against all M input rows, MB rows at a time (then 4, then the rest), while the
// weight rows kAhead bands on (up to `nend`, the thread's range) are prefetched, spread evenly over the
// tiles. Without the prefetch each band waited on memory and then computed with memory idle: at 8-32
// rows this took 1.4-1.7x longer (AMD EPYC, AVX512-BF16, one decode step's linears).
template <typename Op, int MB, int NB>
void band(const typename Op::X* x, const typename Op::T* w, typename Op::T* y, int64_t M, int64_t K, int64_t N,
          int64_t n0, int64_t nend) {
  constexpr int64_t kAhead = 2;  // bands; one ahead left part of the latency exposed (measured)
  const int64_t tiles = M / MB + (M % MB + 3) / 4;
  const int64_t p0 = n0 + kAhead * NB;
  const bool prefetch = p0 + NB <= nend;
  int64_t t = 0, m0 = 0;
  const auto go = [&](auto mb) {
    constexpr int kRows = decltype(mb)::value;
    const int64_t r0 = t * NB / tiles, r1 = (t + 1) * NB / tiles;
    tile<Op, kRows, NB, 1>(x, w, y, K, N, m0, n0, w + (p0 + r0) * K, prefetch ? int(r1 - r0) : 0);
    m0 += kRows;
    ++t;
  };
  while (m0 + MB <= M) go(std::integral_constant<int, MB>());
  while (m0 + 4 <= M) go(std::integral_constant<int, 4>());
  switch (M - m0) {
    case 3: go(std::integral_constant<int, 3>()); break;
    case 2: go(std::integral_constant<int, 2>()); break;
    case 1: go(std::integral_constant<int, 1>()); break;
    default: break;
  }
}

template <typename Op>
void run(const typename Op::X* x, const typename Op::T* w, typename Op::T* y, int64_t M, int64_t K, int64_t N) {
#if !defined(__AMX_BF16__)
  // On the AMX Xeon the prefetching bands beat this at one to four rows too (one decode step's linears,
  // 2 threads: 15.3-17.2 vs 17.4-19.2 ms at one row, 16.8-19.0 vs 23.8-26.3 at four).
  switch (M) {  // bandwidth-bound: one weight row at a time
    case 1: return rows<Op, 1>(x, w, y, K, N);
    case 2: return rows<Op, 2>(x, w, y, K, N);
    case 3: return rows<Op, 3>(x, w, y, K, N);
    case 4: return rows<Op, 4>(x, w, y, K, N);
    default: break;
  }
#endif
  const int64_t bands = N / 4;
  // 6-row tiles (24 accumulators) pay from 17 rows on where there are 32 vector registers.
  const bool six = Vec::W == 16 && M > 16;
  at::parallel_for(0, bands, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (six)
        band<Op, 6, 4>(x, w, y, M, K, N, b * 4, b1 * 4);
      else
        band<Op, 4, 4>(x, w, y, M, K, N, b * 4, b1 * 4);
    }
  });
  for (int64_t n0 = bands * 4; n0 < N; ++n0) band<Op, 4, 1>(x, w, y, M, K, N, n0, N);
}

// The bf16 inputs as the op reads them: in place, or widened to fp32 into `buf` (the kernel serves at most 64
// rows: a few hundred KiB).
template <typename X>
const X* inputs_as(const uint16_t* x, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<X, float>) {
    buf.resize(n);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = uint32_t(x[i]) << 16;
      std::memcpy(&buf[i], &bits, sizeof(float));
    }
    return buf.data();
  } else {
    return x;
  }
}

void check_args(const at::Tensor& x, const at::Tensor& w, at::ScalarType dtype) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == dtype && w.scalar_type() == dtype, "x and w must be ", dtype);
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
}

}  // namespace

at::Tensor vn_ops::linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  check_args(x, w, at::kBFloat16);
  auto xc = x.contiguous();
  auto y = vn_ops::empty({xc.size(0), w.size(0)}, xc.options());
  const int64_t M = xc.size(0), K = xc.size(1);
  std::vector<float> widened;
  run<Bf16>(inputs_as<Bf16::X>(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), M * K, widened),
            reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
            reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), M, K, w.size(0));
  return y;
}

at::Tensor vn_ops::linear_f32(const at::Tensor& x, const at::Tensor& w) {
  check_args(x, w, at::kFloat);
  auto xc = x.contiguous();
  auto y = vn_ops::empty({xc.size(0), w.size(0)}, xc.options());
  run<Widen<float>>(xc.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), xc.size(0), xc.size(1),
                    w.size(0));
  return y;
}

#endif  // AVX512-BF16 or AVX2 + FMA
