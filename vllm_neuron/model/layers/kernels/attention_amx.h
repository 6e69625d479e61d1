// Many-row paged attention (prefill, verify) on AMX tiles, for bf16 queries over a bf16 cache whose head dim
// is a multiple of 32. Included by paged_attention.cpp only where the compiler targets AMX-BF16.
//
// The vector path (attention_tiles.h) widens keys to fp32 and scores 50-75 GFLOP/s on two cores: a lone
// 32-row prefill over a cached 1,024-token prefix spent 46 ms of 133 in attention on the bundled model.
// Here an item's keys and values are copied once into the order the tile unit takes (B tiles), and each
// block of 16 query vectors is scored 32 keys at a time by TDPBF16PS: Q K^T in two 16x16 fp32 tiles. The
// online softmax runs in fp32 on those scores with no horizontal reduction in the common case (a row's max
// is recomputed only when a score passes it; denominators are kept per lane); the probabilities, rounded to
// bf16 (as flash attention does on GPUs), multiply V in tiles that hold the item's fp32 sums across blocks.
// 30 layers of the bundled model's attention, 2 threads: 32 rows over 1,024 cached tokens 6.7 ms (the vector
// path: 30-36 ms); a 512-token prefill 31 ms (100 ms).
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "attention_bf16.h"
#include "online_softmax.h"

namespace attn_amx {

using attn_bf16::kKeys;
using attn_bf16::Scratch;
using attn_bf16::pack;

// Tiles: 0 and 1 the scores of a block's keys 0-15 and 16-31 (then B tiles of values), 2 an A tile (queries,
// then probabilities), 3 a B tile (keys, then values), 4..7 C tiles of output sums.
inline void configure() {
  amx::TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// The output sums of 16 query vectors x DV * 16 dims held in C tiles 4.. across key blocks (DV <= 4; the
// tile unit has 8): zeroed, stored, loaded, and += P (tile 2) x V (the block's DV B tiles at vb), the B
// tiles rotating through 3, 0, 1 so that one load need not wait for the product before it.
template <int DV>
inline void held_zero() {
  _tile_zero(4);
  if constexpr (DV > 1) _tile_zero(5);
  if constexpr (DV > 2) _tile_zero(6);
  if constexpr (DV > 3) _tile_zero(7);
}
template <int DV>
inline void held_store(float* a, int64_t D) {
  _tile_stored(4, a, D * 4);
  if constexpr (DV > 1) _tile_stored(5, a + 16, D * 4);
  if constexpr (DV > 2) _tile_stored(6, a + 32, D * 4);
  if constexpr (DV > 3) _tile_stored(7, a + 48, D * 4);
}
template <int DV>
inline void held_load(const float* a, int64_t D) {
  _tile_loadd(4, a, D * 4);
  if constexpr (DV > 1) _tile_loadd(5, a + 16, D * 4);
  if constexpr (DV > 2) _tile_loadd(6, a + 32, D * 4);
  if constexpr (DV > 3) _tile_loadd(7, a + 48, D * 4);
}
template <int DV>
inline void held_pv(const uint32_t* vb) {
  _tile_loadd(3, vb, 64);
  _tile_dpbf16ps(4, 2, 3);
  if constexpr (DV > 1) {
    _tile_loadd(0, vb + 256, 64);
    _tile_dpbf16ps(5, 2, 0);
  }
  if constexpr (DV > 2) {
    _tile_loadd(1, vb + 512, 64);
    _tile_dpbf16ps(6, 2, 1);
  }
  if constexpr (DV > 3) {
    _tile_loadd(3, vb + 768, 64);
    _tile_dpbf16ps(7, 2, 3);
  }
}

// One item: nq query vectors qf [nq][D] (fp32, scaled) over the keys first..last packed by `pack`, vector qi
// seeing keys qlo[qi]..qpos[qi]. Leaves the running max m, the denominator l and the unnormalized sums acc
// ([ceil(nq / 16) * 16][D]: rows past nq are scratch) as the vector path does. DV = D / 16 when the sums
// stay in tiles (D <= 64), else 0: each block's products then go through memory.
template <int DV>
void item_dv(const float* qf, int64_t nq, const int64_t* qpos, const int64_t* qlo, int64_t first, int64_t D,
             Scratch& s, float* m, float* l, float* acc) {
  const int64_t nqp = (nq + 15) / 16 * 16, dc = D / 32, dv = D / 16;
  attn_bf16::queries(qf, nq, nqp, D, s);
  if constexpr (DV == 0) std::fill(acc, acc + nqp * D, 0.f);  // held sums start as zero tiles
  configure();
  alignas(64) float sc[16][kKeys];
  alignas(64) uint16_t p[16][kKeys];
  float corr[16];
  __m512 lv[16];  // each row's denominator, per lane
  for (int64_t rb = 0; rb < nqp; rb += 16) {
    const int64_t rows = std::min<int64_t>(16, nq - rb);
    const auto [lo, hi] = start_rows(qpos, qlo, rb, rows, m, l);
    const uint16_t* qa = s.qa.data() + rb * D;
    float* a = acc + rb * D;
    if constexpr (DV > 0) held_zero<DV>();
    for (int r = 0; r < 16; ++r) lv[r] = _mm512_setzero_ps();
    for (int64_t blk = (lo - first) / kKeys; blk <= (hi - first) / kKeys; ++blk) {
      const int64_t t0 = first + blk * kKeys;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t c = 0; c < dc; ++c) {
        _tile_loadd(2, qa + c * 32, D * 2);
        _tile_loadd(3, s.kbp + (2 * blk * dc + c) * 256, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(3, s.kbp + ((2 * blk + 1) * dc + c) * 256, 64);
        _tile_dpbf16ps(1, 2, 3);
      }
      _tile_stored(0, &sc[0][0], kKeys * 4);
      _tile_stored(1, &sc[0][16], kKeys * 4);
      const bool rescale = attn_bf16::softmax_block<16>(sc, rb, rows, t0, qpos, qlo, m, lv, p, corr);
      if (rescale) {
        if constexpr (DV > 0) held_store<DV>(a, D);
        for (int64_t r = 0; r < 16; ++r)
          if (corr[r] != 1.f)
            for (int64_t i = 0; i < D; i += 16)
              _mm512_storeu_ps(a + r * D + i, _mm512_mul_ps(_mm512_loadu_ps(a + r * D + i), _mm512_set1_ps(corr[r])));
        if constexpr (DV > 0) held_load<DV>(a, D);
      }
      _tile_loadd(2, &p[0][0], kKeys * 2);
      if constexpr (DV > 0) {
        held_pv<DV>(s.vbp + blk * DV * 256);
      } else {
        for (int64_t c = 0; c < dv; ++c) {
          _tile_loadd(4, a + c * 16, D * 4);
          _tile_loadd(3, s.vbp + (blk * dv + c) * 256, 64);
          _tile_dpbf16ps(4, 2, 3);
          _tile_stored(4, a + c * 16, D * 4);
        }
      }
    }
    if constexpr (DV > 0) held_store<DV>(a, D);
    for (int64_t r = 0; r < rows; ++r) l[rb + r] = _mm512_reduce_add_ps(lv[r]);
  }
  attn_bf16::natural_max(m, nq);
  _tile_release();
}

inline void item(const float* qf, int64_t nq, const int64_t* qpos, const int64_t* qlo, int64_t first, int64_t D,
                 Scratch& s, float* m, float* l, float* acc) {
  switch (D) {
    case 32: item_dv<2>(qf, nq, qpos, qlo, first, D, s, m, l, acc); break;
    case 64: item_dv<4>(qf, nq, qpos, qlo, first, D, s, m, l, acc); break;
    default: item_dv<0>(qf, nq, qpos, qlo, first, D, s, m, l, acc); break;
  }
}

}  // namespace attn_amx
