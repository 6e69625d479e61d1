// AMX tile linear for bf16 on Xeons with AMX: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), M up to 64.
//
// Between the weight-streaming kernel's four rows and the big prefills, a step's linears are still bound by
// reading the weights once, and oneDNN, even on weights reordered once (packed_weights.py), read them at about
// half the bandwidth. Here the weights are packed once at load into the order the tile unit takes them: one
// 1 KiB B tile per 16 output columns x 32 inputs ([N/16][K/32][16 pairs][16 columns][2]), so each thread
// streams its columns' tiles front to back while the prefetcher pulls the tiles of a block ahead. The
// inputs (at most 64 rows: four C tiles of 16 rows) stay in L1/L2 and are loaded as A tiles per step. The
// products are exact and summed in fp32 (TDPBF16PS); the fp32 sums are rounded to bf16 once.
// Built only where the compiler targets AMX (the avx512bf16 build on such a CPU).

#include "op_isa.h"

#ifdef VN_OPS_LINEAR_AMX
#include "op_table.h"
#include "tile_linear_args.h"
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "amx_tiles.h"

namespace {

constexpr int64_t kTileN = 16, kTileK = 32, kTileElems = kTileN * kTileK;  // one B tile, in bf16
constexpr int64_t kMaxRows = 64;                                             // four C tiles of 16 rows
// Up to kL2Rows rows the next column block is prefetched into L2 (PREFETCHT1); above, the block after next
// into L1. linear_dot_tiles.cpp's rule (measured on a Zen 5 EPYC) switches to L1 above 16 rows; on an AMX
// Xeon (2-core VM, `benchmarks/ab_steps.py`, 3-4 rounds each, 2026-12-07) L2 one block on won at 16 rows
// (decode_b16 21.35 -> 18.74 ms against L1 two on) and at 32 too (prefill_s32 23.41 -> 21.32 and 23.75 ->
// 21.28 ms against the rule at 16), with every other step within noise (no other step reaches these rows):
// a B tile is read once per K step however many A tiles meet it, and L1 fetches two blocks on evicted lines
// still in use. The engine gives this kernel at most 32 rows (cpu_caps.AMX_ROWS); 33-64 keep L1 two on.
constexpr int64_t kL2Rows = 32;

struct Prefetch {
  int64_t ahead;  // column blocks
  bool to_l2;
};
constexpr Prefetch prefetch_for(int64_t M) { return M <= kL2Rows ? Prefetch{1, true} : Prefetch{2, false}; }

using amx::TileConfig;

// One block of 16 output columns for MT C tiles: the block's K/32 B tiles against the inputs' A tiles;
// sums left in cbuf [MT * 16][16] fp32.
template <int MT, bool ToL2>
void column_block(const uint16_t* x, int64_t K, const uint16_t* wb, const uint16_t* pf, float* cbuf) {
  const int64_t xs = K * 2;  // A tile row stride in bytes
  _tile_zero(0);
  if constexpr (MT > 1) _tile_zero(1);
  if constexpr (MT > 2) _tile_zero(2);
  if constexpr (MT > 3) _tile_zero(3);
  for (int64_t k = 0; k < K; k += kTileK) {
    const uint16_t* b = wb + (k / kTileK) * kTileElems;
    if (pf != nullptr)
      for (int64_t o = 0; o < kTileElems * 2; o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pf + (k / kTileK) * kTileElems) + o,
                     ToL2 ? _MM_HINT_T1 : _MM_HINT_T0);
    _tile_loadd(6, b, 64);
    // C tile c += input rows 16 c.. (A tile a) x the B tile.
#define VN_ROWS_TIMES_B(c, a)                  \
  do {                                         \
    _tile_loadd(a, x + k + 16 * (c) * K, xs); \
    _tile_dpbf16ps(c, a, 6);                   \
  } while (0)
    VN_AMX_ROW_TILES(MT, VN_ROWS_TIMES_B);
#undef VN_ROWS_TIMES_B
  }
  _tile_stored(0, cbuf, 64);
  if constexpr (MT > 1) _tile_stored(1, cbuf + 256, 64);
  if constexpr (MT > 2) _tile_stored(2, cbuf + 512, 64);
  if constexpr (MT > 3) _tile_stored(3, cbuf + 768, 64);
}

template <int MT>
void run(const uint16_t* x, const uint16_t* packed, const uint16_t* bias, uint16_t* y, int64_t M, int64_t K,
         int64_t N) {
  constexpr Prefetch plan = prefetch_for(16 * MT);  // MT C tiles: up to 16 * MT rows
  const int64_t blocks = N / kTileN, block_elems = (K / kTileK) * kTileElems;
  const TileConfig cfg = amx::row_tiles_config(M, 64, 16);  // bf16: 32 inputs per A row, 16 pairs per B tile
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    _tile_loadconfig(&cfg);
    alignas(64) float cbuf[kMaxRows * kTileN];
    __m512 bv = _mm512_setzero_ps();
    for (int64_t b = b0; b < b1; ++b) {
      const uint16_t* pf = b + plan.ahead < b1 ? packed + (b + plan.ahead) * block_elems : nullptr;
      column_block<MT, plan.to_l2>(x, K, packed + b * block_elems, pf, cbuf);
      if (bias != nullptr)
        bv = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + b * kTileN))), 16));
      for (int64_t m = 0; m < M; ++m) {
        const __m512 v = _mm512_add_ps(_mm512_load_ps(cbuf + m * kTileN), bv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * N + b * kTileN),
                            (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
    _tile_release();
  });
}

}  // namespace

at::Tensor vn_ops::linear_amx(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                              int64_t N) {
  TORCH_CHECK(amx::tiles_permitted(), "the kernel did not get the AMX tile state from the OS");
  check_tile_linear_args(x, packed, bias, N);
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, "x must have 1 to 64 rows");
  auto xc = x.contiguous();
  auto y = vn_ops::empty({M, N}, xc.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  const auto* bp = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr<at::BFloat16>()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  switch ((M + 15) / 16) {
    case 1: run<1>(xp, wp, bp, yp, M, K, N); break;
    case 2: run<2>(xp, wp, bp, yp, M, K, N); break;
    case 3: run<3>(xp, wp, bp, yp, M, K, N); break;
    default: run<4>(xp, wp, bp, yp, M, K, N); break;
  }
  return y;
}

#endif  // AMX-BF16 and AVX512-BF16
