// bf16 linear by VDPBF16PS on weights packed once in tile order: y[M, N] = x[M, K] @ w[N, K]^T (+ bias).
//
// On AVX512-BF16 CPUs without AMX, the weight-streaming kernel (linear_bf16.cpp) reduces each output's 16
// lanes at the end of K, and oneDNN, even on weights reordered once, reached 550-830 GFLOP/s on the bundled
// model's shapes from 16 to 128 rows. Here the weights come in the AMX kernel's order
// (packed_weights.pack_tiles: [N/16][K/2 pairs][16 columns][2]), so one 64-byte load holds a k-pair for 16
// output columns, and an outer product needs no reduction: each step broadcasts one input row's k-pair and
// multiplies it into NB column blocks, 8 rows x NB blocks of fp32 sums in registers. A thread walks its
// groups of NB column blocks front to back (one sequential stream per block), runs every 8-row block of the
// input against a group while it sits in L1/L2, and prefetches a group ahead spread over those row blocks:
// up to 16 rows the next group into L2 only, above the group after next into L1 (ToL2 below). One step's
// linears on the bundled model (30 layers, 2 threads, AMD EPYC Zen 5, weights from memory): 5.2 vs 7.0 ms
// at 16 rows (weight-streaming kernel), 8.3 vs 12.1 at 32, 14.9 vs 20.8 at 64 and 27.6 vs 32.9 at 128
// (oneDNN reordered), 102 vs 109 at 512. The products are exact and summed in fp32; the sums are rounded to
// bf16 once.

#include <type_traits>

#include "op_isa.h"

#ifdef VN_OPS_DOT_TILES
#include "op_table.h"
#include "tile_linear_args.h"
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "simd.h"

namespace {

constexpr int64_t kBlockN = 16;  // output columns per packed block (one zmm of fp32 sums)
constexpr int kRows = 8;         // input rows per register block: 8 x 3 blocks = 24 sums + 3 weights + 1 input
// Up to kL2Rows rows the group after this one is prefetched into L2 (PREFETCHT1); above, the group after next
// into L1. Prefetching into L1 two groups on (2 x 36 KiB at K = 576, while up to two row blocks re-read the
// current group) evicts lines still in use: one step's linears of the bundled model (2 threads, Zen 5 EPYC,
// in one process, alternating, three runs) took 11.2-11.7 vs 12.8-15.6 ms at 4 rows and 15.7-16.9 vs
// 17.6-20.1 at 16; at 32 rows 26.6 vs 25.4 and at 64 53.2 vs 51.6, so L1 two on stays there. Without any
// prefetch: 16.1 (8 rows) and 21.2 ms (16).
constexpr int64_t kL2Rows = 16;

// Rows x NB blocks over all of K. `pf`: `npf` cache lines to prefetch, spread evenly over the K steps by a
// running credit (a division per step cost more than the prefetch saved).
template <int Rows, int NB, bool ToL2>
void block(const uint16_t* x, int64_t K, const uint16_t* wg, int64_t block_elems, const uint16_t* bias,
           uint16_t* y, int64_t N, const char* pf, int64_t npf) {
  __m512 acc[Rows][NB];
  for (int i = 0; i < Rows; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;
  int64_t line = 0, credit = 0;
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j)
      w[j] = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(wg + j * block_elems + p * 32));
    for (credit += npf; credit >= pairs; credit -= pairs)
      _mm_prefetch(pf + 64 * line++, ToL2 ? _MM_HINT_T1 : _MM_HINT_T0);
    for (int i = 0; i < Rows; ++i) {
      const __m512bh xi = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + i * K + 2 * p));
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xi, w[j]);
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m512 b = bias == nullptr ? _mm512_setzero_ps() : vn_simd::Vec::load(bias + j * kBlockN);
    for (int i = 0; i < Rows; ++i)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * N + j * kBlockN),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][j], b)));
  }
}

// Every row of x against one group of NB column blocks; the prefetch of `pflines` lines from `pf` is shared
// out over the row blocks.
template <int NB, bool ToL2>
void group(const uint16_t* x, const uint16_t* wg, const uint16_t* bias, uint16_t* y, int64_t M, int64_t K,
           int64_t N, const char* pf, int64_t pflines) {
  const int64_t block_elems = K * kBlockN, blocks = (M + kRows - 1) / kRows;
  int64_t t = 0, m0 = 0;
  const auto go = [&](auto rows) {
    constexpr int R = decltype(rows)::value;
    const int64_t l0 = t * pflines / blocks, l1 = (t + 1) * pflines / blocks;
    block<R, NB, ToL2>(x + m0 * K, K, wg, block_elems, bias, y + m0 * N, N,
                       pf == nullptr ? nullptr : pf + 64 * l0, pf == nullptr ? 0 : l1 - l0);
    m0 += R;
    ++t;
  };
  while (m0 + kRows <= M) go(std::integral_constant<int, kRows>());
  switch (M - m0) {
    case 7: go(std::integral_constant<int, 7>()); break;
    case 6: go(std::integral_constant<int, 6>()); break;
    case 5: go(std::integral_constant<int, 5>()); break;
    case 4: go(std::integral_constant<int, 4>()); break;
    case 3: go(std::integral_constant<int, 3>()); break;
    case 2: go(std::integral_constant<int, 2>()); break;
    case 1: go(std::integral_constant<int, 1>()); break;
    default: break;
  }
}

// Groups of NB blocks (the last may hold fewer), split into one contiguous range per thread.
template <int NB, bool ToL2>
void run(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y, int64_t M, int64_t K,
         int64_t N) {
  const int64_t blocks = N / kBlockN, groups = (blocks + NB - 1) / NB, group_elems = NB * K * kBlockN;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * NB * kBlockN, nb = std::min<int64_t>(NB, blocks - g * NB);
      const uint16_t* wg = packed + g * group_elems;
      const uint16_t* bg = bias == nullptr ? nullptr : bias + n0;
      const int64_t ahead = g + (ToL2 ? 1 : 2);
      const char* pf = ahead < g1 ? reinterpret_cast<const char*>(packed + ahead * group_elems) : nullptr;
      const int64_t pflines = ahead + 1 < groups ? group_elems * 2 / 64 : (blocks - ahead * NB) * K * kBlockN * 2 / 64;
      if (nb == NB)
        group<NB, ToL2>(x, wg, bg, y + n0, M, K, N, pf, pflines);
      else if (nb == 2)
        group<2, ToL2>(x, wg, bg, y + n0, M, K, N, nullptr, 0);
      else
        group<1, ToL2>(x, wg, bg, y + n0, M, K, N, nullptr, 0);
    }
  });
}

}  // namespace

at::Tensor vn_ops::linear_dot_tiles(const at::Tensor& x, const at::Tensor& packed,
                                    const c10::optional<at::Tensor>& bias, int64_t N) {
  check_tile_linear_args(x, packed, bias, N);
  const int64_t M = x.size(0), K = x.size(1);
  auto xc = x.contiguous();
  auto y = vn_ops::empty({M, N}, xc.options());
  if (M == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const auto* bp = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  // Up to 32 rows a group of two blocks (2 x K x 32 bytes: 36 KiB at K = 576) stays in L1 across the row
  // blocks; above, three blocks per broadcast pay (measured 5-10% either way).
  if (M <= kL2Rows)
    run<2, true>(xp, wp, bp, yp, M, K, N);
  else if (M <= 32)
    run<2, false>(xp, wp, bp, yp, M, K, N);
  else
    run<3, false>(xp, wp, bp, yp, M, K, N);
  return y;
}

#endif  // AVX512-BF16
