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
#include "online_softmax.h"

namespace attn_amx {

constexpr int64_t kKeys = 32;  // keys per block: P's A tile is 16 query vectors x 32 keys

// Per-thread scratch, grown to the largest item.
struct Scratch {
  std::vector<uint32_t> kb, vb;  // packed keys / values, bf16 pairs
  std::vector<uint16_t> qa;      // queries, bf16
  std::vector<int64_t> off;      // each key's slot, in elements
};

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

// exp(x) for x <= 0 (-inf included: -> ~1e-38), online_softmax.h's polynomial with the power of two applied
// by VSCALEFPS.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, fi);
}

// rows[i] (16 dwords each) -> rows[i] = the i-th column: 16 x 16 32-bit transpose in registers.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4g + c]: rows 4g..4g + 3 of columns c, c + 4, c + 8, c + 12 in its four 128-bit lanes.
  __m512i u[16];
  for (int g = 0; g < 16; g += 4) {
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// Keys and values first..first + n - 1 of one KV head (slot s of the cache holds the head's key at
// k0 + s * slot_stride, its value at v0 + s * slot_stride), zeros up to whole blocks of 32 keys:
//   kb: B tiles of Q K^T, [16-key group][D/32][16 pairs of dims][16 keys] (pairs of bf16 as one uint32);
//   vb: B tiles of P V, [32-key block][D/16][16 pairs of keys][16 dims].
inline void pack(const uint16_t* k0, const uint16_t* v0, const int64_t* table, int64_t block_size,
                 int64_t slot_stride, int64_t first, int64_t n, int64_t D, Scratch& s) {
  const int64_t nb = (n + kKeys - 1) / kKeys, dc = D / 32, dv = D / 16;
  s.kb.resize(nb * kKeys * D / 2);
  s.vb.resize(nb * kKeys * D / 2);
  s.off.resize(nb * kKeys);
  for (int64_t j = 0, b = first / block_size, i = first % block_size; j < n; ++j) {  // no division per key
    s.off[j] = (table[b] * block_size + i) * slot_stride;
    if (++i == block_size) {
      i = 0;
      ++b;
    }
  }
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j0 = 0; j0 < nb * kKeys; j0 += 16) {
    for (int64_t c = 0; c < dc; ++c) {
      __m512i r[16];
      for (int64_t j = 0; j < 16; ++j)
        r[j] = j0 + j < n ? _mm512_loadu_si512(k0 + s.off[j0 + j] + c * 32) : zero;
      transpose16(r);
      uint32_t* kt = s.kb.data() + ((j0 / 16) * dc + c) * 256;
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(kt + p * 16, r[p]);
    }
  }
  // A pair of keys' values interleaved: the low half of each uint32 from the even key.
  for (int64_t j = 0; j < nb * kKeys; j += 2) {
    uint32_t* vbk = s.vb.data() + (j / kKeys) * dv * 256 + ((j % kKeys) / 2) * 16;
    for (int64_t c = 0; c < dv; ++c) {
      const __m512i even = j < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                       reinterpret_cast<const __m256i*>(v0 + s.off[j] + c * 16)))
                                 : zero;
      const __m512i odd = j + 1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                          reinterpret_cast<const __m256i*>(v0 + s.off[j + 1] + c * 16)))
                                    : zero;
      _mm512_storeu_si512(vbk + c * 256, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
    }
  }
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
  s.qa.resize(nqp * D);
  for (int64_t i = 0; i < nq * D; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.qa.data() + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(qf + i)));
  std::fill(s.qa.begin() + nq * D, s.qa.begin() + nqp * D, 0);
  if constexpr (DV == 0) std::fill(acc, acc + nqp * D, 0.f);  // held sums start as zero tiles
  configure();
  alignas(64) float sc[16][kKeys];
  alignas(64) uint16_t p[16][kKeys];
  float corr[16];
  __m512 lv[16];  // each row's denominator, per lane
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
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
        _tile_loadd(3, s.kb.data() + (2 * blk * dc + c) * 256, 64);
        _tile_dpbf16ps(0, 2, 3);
        _tile_loadd(3, s.kb.data() + ((2 * blk + 1) * dc + c) * 256, 64);
        _tile_dpbf16ps(1, 2, 3);
      }
      _tile_stored(0, &sc[0][0], kKeys * 4);
      _tile_stored(1, &sc[0][16], kKeys * 4);
      bool rescale = false;  // some row's sums so far must shrink to a new max
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t qi = rb + r;
        corr[r] = 1.f;
        // Keys of the block this vector sees: j0..visible - 1 (causal, then the window's first key).
        const int64_t visible = r < rows ? std::min<int64_t>(kKeys, qpos[qi] - t0 + 1) : 0;
        const int64_t j0 = r < rows ? std::max<int64_t>(0, qlo[qi] - t0) : 0;
        if (visible <= j0) {
          _mm512_store_si512(p[r], _mm512_setzero_si512());
          continue;
        }
        const auto seen = [&](int64_t base) {
          const int64_t a0 = std::clamp<int64_t>(j0 - base, 0, 16), a1 = std::clamp<int64_t>(visible - base, 0, 16);
          return static_cast<__mmask16>(((1u << a1) - 1) & ~((1u << a0) - 1));
        };
        const __mmask16 k0 = seen(0), k1 = seen(16);
        const __m512 s0 = _mm512_mask_blend_ps(k0, neg_inf, _mm512_load_ps(sc[r]));
        const __m512 s1 = _mm512_mask_blend_ps(k1, neg_inf, _mm512_load_ps(sc[r] + 16));
        // The max moves only where a score passes it (rarely, once past the first blocks): a compare per
        // row instead of a horizontal max.
        const __m512 mold = _mm512_set1_ps(m[qi]);
        const bool up = (_mm512_cmp_ps_mask(s0, mold, _CMP_GT_OQ) | _mm512_cmp_ps_mask(s1, mold, _CMP_GT_OQ)) != 0;
        const float mx = up ? _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)) : m[qi];
        const __m512 mv = _mm512_set1_ps(mx);
        const __m512 e0 = _mm512_maskz_mov_ps(k0, exp_nonpositive(_mm512_sub_ps(s0, mv)));
        const __m512 e1 = _mm512_maskz_mov_ps(k1, exp_nonpositive(_mm512_sub_ps(s1, mv)));
        const __m512i pw = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
        _mm512_store_si512(p[r], pw);
        // The denominator sums the probabilities as rounded, the values they weigh V with.
        const __m512 r0 = _mm512_castsi512_ps(_mm512_slli_epi32(pw, 16));
        const __m512 r1 = _mm512_castsi512_ps(_mm512_and_si512(pw, _mm512_set1_epi32(0xFFFF0000u)));
        if (mx != m[qi] && m[qi] != -std::numeric_limits<float>::infinity()) {
          corr[r] = ::exp_nonpositive(m[qi] - mx);
          rescale = true;
        }
        // Kept per lane, summed across lanes once per row block.
        lv[r] = _mm512_fmadd_ps(lv[r], _mm512_set1_ps(corr[r]), _mm512_add_ps(r0, r1));
        m[qi] = mx;
      }
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
        held_pv<DV>(s.vb.data() + blk * DV * 256);
      } else {
        for (int64_t c = 0; c < dv; ++c) {
          _tile_loadd(4, a + c * 16, D * 4);
          _tile_loadd(3, s.vb.data() + (blk * dv + c) * 256, 64);
          _tile_dpbf16ps(4, 2, 3);
          _tile_stored(4, a + c * 16, D * 4);
        }
      }
    }
    if constexpr (DV > 0) held_store<DV>(a, D);
    for (int64_t r = 0; r < rows; ++r) l[rb + r] = _mm512_reduce_add_ps(lv[r]);
  }
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
