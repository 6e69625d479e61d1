// int8 weights against int8 activations (W8A8) by VPDPBUSD outer products: y[M, N] = x[M, K] @ W^T (+ bias),
// W = q * scale[n] (quant_int8: symmetric, one scale per output row).
//
// The same scheme as the int4 tile kernel (linear_int4_tiles.cpp; activations made int8 per row and group of
// 32, int8_acts.h). VPDPBUSD wants one operand unsigned: the activation codes are shifted to qx + 128 (1..255)
// and each group's sum over a column gains 128 * sum_k q_k, which the weights' copy holds per column and group
// (`corr`) and the kernel subtracts before scaling:
//   sum_k w_k x_k ~= scale[n] * sum_g d_x[g] * (sum_{k in g} (qx_k + 128) q_k - corr[n][g]),
// 8 VPDPBUSD, a subtraction, a conversion and an FMA per group, row and 16 columns (11 instructions per 512
// products where bf16 takes 16); the column scale once at the end.
//
// Weights in tile order (quant_int8.to_tiles): per 16 output columns, per 4 inputs, 64 bytes (column c's 4
// codes in its 4 bytes), read in place (no unpacking); `corr` int32 [N / 16][K / 32][16].
//
// On Xeons with AMX-INT8 that order is also TDPBUSD's B tile: a group's 8 quads of 64 bytes are one B tile
// (8 rows x 16 columns x 4 codes) against an A tile of 16 rows x the group's 32 unsigned codes, so one tile
// product replaces 8 VPDPBUSD per row; its int32 sums go through memory (a tile store) to the same
// subtraction, conversion and FMA per row, in the same order, so both paths give the same bits. The build
// takes that path from kAmxFromRows rows on where the OS hands out tile state (`linear_int8_amx` runs it at
// any row count, for tests and benchmarks).

#include <algorithm>
#include <type_traits>
#include <vector>

#include "op_isa.h"

#ifdef VN_OPS_INT_TILES
#include "op_table.h"
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "int8_acts.h"
#ifdef VN_OPS_INT8_AMX
#include "amx_tiles.h"
#endif

namespace {

using vn_acts::Acts;
using vn_acts::kGroup;

constexpr int64_t kCols = 16;  // output columns per block (one zmm of sums)
constexpr int64_t kAhead = 2;  // column blocks ahead prefetched into L2

template <int R, typename T>
void block(const int8_t* w, const int32_t* corr, const float* scale, const Acts& a, int64_t r0, int64_t K, T* y,
           int64_t N, const float* bias, const char* pf, int64_t pflines) {
  const int64_t G = K / kGroup;
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  int64_t line = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (pf != nullptr)  // this block's share of the block kAhead on, spread over the groups
      for (const int64_t end = (g + 1) * pflines / G; line < end; ++line) _mm_prefetch(pf + 64 * line, _MM_HINT_T1);
    __m512i isum[R];
    for (int i = 0; i < R; ++i) isum[i] = _mm512_setzero_si512();
    const int8_t* wg = w + g * kGroup * kCols;
    for (int t = 0; t < 8; ++t) {
      const __m512i wv = _mm512_loadu_si512(wg + t * 64);
      for (int i = 0; i < R; ++i) {
        const int32_t xq = *reinterpret_cast<const int32_t*>(a.q.data() + (r0 + i) * K + g * kGroup + 4 * t);
        isum[i] = _mm512_dpbusd_epi32(isum[i], _mm512_set1_epi32(xq), wv);
      }
    }
    const __m512i c = _mm512_loadu_si512(corr + g * kCols);
    for (int i = 0; i < R; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(isum[i], c)),
                               _mm512_set1_ps(a.d[(r0 + i) * G + g]), acc[i]);
  }
  const __m512 s = _mm512_loadu_ps(scale), b = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias);
  for (int i = 0; i < R; ++i) vn_acts::store16(y + (r0 + i) * N, _mm512_fmadd_ps(acc[i], s, b));
}

template <typename T>
void run(const Acts& a, const int8_t* codes, const int32_t* corr, const float* scale, const float* bias, T* y,
         int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / kCols, G = K / kGroup, block_bytes = K * kCols;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t cb = b0; cb < b1; ++cb) {
      const int8_t* w = codes + cb * block_bytes;
      const int32_t* cc = corr + cb * G * kCols;
      const float* bb = bias == nullptr ? nullptr : bias + cb * kCols;
      T* yb = y + cb * kCols;
      const bool ahead = cb + kAhead < b1;
      const char* pf = reinterpret_cast<const char*>(codes + (cb + kAhead) * block_bytes);
      const int64_t row_blocks = (M + 7) / 8, lines = block_bytes / 64;
      int64_t rb = 0;
      vn_acts::row_blocks(M, [&](auto rows, int64_t r0) {
        const int64_t l0 = rb * lines / row_blocks, l1 = (rb + 1) * lines / row_blocks;
        block<decltype(rows)::value>(w, cc, scale + cb * kCols, a, r0, K, yb, N, bb, ahead ? pf + 64 * l0 : nullptr,
                                     l1 - l0);
        ++rb;
      });
    }
  });
}

#ifdef VN_OPS_INT8_AMX
// From this many rows the tile path. One step's 120 layer linears of the bundled model (2-core AMX Xeon VM,
// bf16 inputs, both paths in one process, three runs, 2026-12-07), tiles / VNNI: 1.05-1.12 at 2-4 rows,
// 0.96-1.06 at 8, 0.89-0.98 at 16, 0.93-0.97 at 32, 0.87-0.92 at 64, 0.84-0.99 at 128; with every pass of 64
// rows meeting a block while it is cached (two more runs): 0.91-0.93 at 16, 0.89-0.97 at 64, 0.83-0.88 at 128,
// 0.83-0.86 at 256. The tile product is cheap; what stays is the per-group work both paths share (the
// sums to fp32, times the group's activation scale, added up per row), which groups of 32 put after every tile
// product: accumulating several groups in a tile needs one scale over them. (Tile products for a chunk of
// groups first, then the float work with the sum in a register, ran 1.2-1.3x slower.)
constexpr int64_t kAmxFromRows = 16;
constexpr int64_t kAmxMaxTiles = 4;  // C tiles of 16 rows per pass over a column block (64 rows)

// MT C tiles (rows r0.., `rows` of them) against one column block: per group, the tile products into zeroed C
// tiles, stored to `sums`, then per row (sum - corr) * d_x + acc, as block() does.
template <int MT, typename T>
void amx_block(const int8_t* w, const int32_t* corr, const float* scale, const Acts& a, int64_t r0, int64_t rows,
               int64_t K, T* y, int64_t N, const float* bias, const char* pf, int64_t pflines) {
  const int64_t G = K / kGroup;
  alignas(64) int32_t sums[kAmxMaxTiles * 16 * kCols];
  alignas(64) float acc[kAmxMaxTiles * 16 * kCols];
  for (int64_t i = 0; i < rows * kCols; ++i) acc[i] = 0.0f;
  const uint8_t* xq = reinterpret_cast<const uint8_t*>(a.q.data()) + r0 * K;
  int64_t line = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (pf != nullptr)
      for (const int64_t end = (g + 1) * pflines / G; line < end; ++line) _mm_prefetch(pf + 64 * line, _MM_HINT_T1);
    _tile_loadd(6, w + g * kGroup * kCols, 64);
    const uint8_t* xg = xq + g * kGroup;
#define VN_INT8_ROWS(c, t)                 \
  do {                                     \
    _tile_zero(c);                         \
    _tile_loadd(t, xg + 16 * (c) * K, K);  \
    _tile_dpbusd(c, t, 6);                 \
    _tile_stored(c, sums + (c) * 256, 64); \
  } while (0)
    VN_AMX_ROW_TILES(MT, VN_INT8_ROWS);
#undef VN_INT8_ROWS
    const __m512i c = _mm512_loadu_si512(corr + g * kCols);
    for (int64_t i = 0; i < rows; ++i) {
      const __m512i s = _mm512_load_si512(sums + i * kCols);
      _mm512_store_ps(acc + i * kCols, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s, c)),
                                                       _mm512_set1_ps(a.d[(r0 + i) * G + g]),
                                                       _mm512_load_ps(acc + i * kCols)));
    }
  }
  const __m512 s = _mm512_loadu_ps(scale), b = bias == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(bias);
  for (int64_t i = 0; i < rows; ++i) vn_acts::store16(y + (r0 + i) * N, _mm512_fmadd_ps(_mm512_load_ps(acc + i * kCols), s, b));
}

template <typename T>
void amx_run(const Acts& a, const int8_t* codes, const int32_t* corr, const float* scale, const float* bias, T* y,
             int64_t M, int64_t K, int64_t N) {
  const int64_t blocks = N / kCols, G = K / kGroup, block_bytes = K * kCols, lines = block_bytes / 64;
  const int64_t pass_rows = 16 * kAmxMaxTiles, passes = (M + pass_rows - 1) / pass_rows;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    // Every pass of up to 64 rows meets a block while its weights are in L1/L2; the config changes only where
    // a pass has other rows than the last one configured (the last pass of a partial 64).
    int64_t configured = 0;
    for (int64_t cb = b0; cb < b1; ++cb) {
      // The next block into L2, spread over this one's groups (linear_amx.cpp's rule up to 32 rows, taken here
      // at every row count).
      const char* pf = cb + 1 < b1 ? reinterpret_cast<const char*>(codes + (cb + 1) * block_bytes) : nullptr;
      const int8_t* w = codes + cb * block_bytes;
      const int32_t* cc = corr + cb * G * kCols;
      const float* bb = bias == nullptr ? nullptr : bias + cb * kCols;
      const float* sc = scale + cb * kCols;
      T* yb = y + cb * kCols;
      for (int64_t p = 0; p < passes; ++p) {
        const int64_t r0 = p * pass_rows, rows = std::min(pass_rows, M - r0);
        if (rows != configured) {
          // A group per A tile row, its 8 quads per B tile.
          const amx::TileConfig cfg = amx::row_tiles_config(rows, kGroup, kGroup / 4);
          _tile_loadconfig(&cfg);
          configured = rows;
        }
        const char* pfp = p == 0 ? pf : nullptr;  // the next block is fetched once, by the first pass
        switch ((rows + 15) / 16) {
          case 1: amx_block<1>(w, cc, sc, a, r0, rows, K, yb, N, bb, pfp, lines); break;
          case 2: amx_block<2>(w, cc, sc, a, r0, rows, K, yb, N, bb, pfp, lines); break;
          case 3: amx_block<3>(w, cc, sc, a, r0, rows, K, yb, N, bb, pfp, lines); break;
          default: amx_block<4>(w, cc, sc, a, r0, rows, K, yb, N, bb, pfp, lines); break;
        }
      }
    }
    if (configured != 0) _tile_release();
  });
}
#endif  // VN_OPS_INT8_AMX

void check_args(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& corr, const at::Tensor& scale) {
  TORCH_CHECK(codes.dim() == 2 && x_in.size(-1) == codes.size(1), "x [M, K], codes [N, K]");
  const int64_t K = x_in.size(-1), N = codes.size(0);
  TORCH_CHECK(K % kGroup == 0 && N % kCols == 0, "K must be a multiple of 32 and N of 16");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.is_contiguous(), "codes must be contiguous int8");
  TORCH_CHECK(corr.scalar_type() == at::kInt && corr.is_contiguous() && corr.numel() == N * K / kGroup,
              "corr must be int32 [N / 16, K / 32, 16]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N, "scale must be float32 [N]");
}

}  // namespace

// x [M, K] (bf16 or fp32) @ the int8 weight in tile order: codes int8 [N, K], corr int32 [N / 16, K / 32, 16],
// scale float32 [N] (quant_int8.to_tiles); bias float32 [N] or none; y in x's dtype.
at::Tensor vn_ops::linear_int8_tiles(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& corr,
                                     const at::Tensor& scale, const c10::optional<at::Tensor>& bias) {
  check_args(x_in, codes, corr, scale);
  const int64_t K = x_in.size(-1), N = codes.size(0);
  return vn_acts::with_int8_rows(x_in, N, bias, true, [&](const Acts& a, auto* yp) {
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    const int64_t M = a.q.size() / K;
#ifdef VN_OPS_INT8_AMX
    if (M >= kAmxFromRows && amx::tiles_permitted()) {
      amx_run(a, codes.data_ptr<int8_t>(), corr.data_ptr<int32_t>(), scale.data_ptr<float>(), bp, yp, M, K, N);
      return;
    }
#endif
    run(a, codes.data_ptr<int8_t>(), corr.data_ptr<int32_t>(), scale.data_ptr<float>(), bp, yp, M, K, N);
  });
}

#ifdef VN_OPS_INT8_AMX
// The tile path at any row count (tests, benchmarks): the same arguments and bits as linear_int8_tiles.
at::Tensor vn_ops::linear_int8_amx(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& corr,
                                   const at::Tensor& scale, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx::tiles_permitted(), "the kernel did not get the AMX tile state from the OS");
  check_args(x_in, codes, corr, scale);
  const int64_t K = x_in.size(-1), N = codes.size(0);
  return vn_acts::with_int8_rows(x_in, N, bias, true, [&](const Acts& a, auto* yp) {
    const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    amx_run(a, codes.data_ptr<int8_t>(), corr.data_ptr<int32_t>(), scale.data_ptr<float>(), bp, yp,
            static_cast<int64_t>(a.q.size() / K), K, N);
  });
}
#endif

#endif  // AVX512-VNNI
