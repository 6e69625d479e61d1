// Many-row paged attention (prefill, verify) by bf16 dot products, for bf16 queries over a bf16 cache whose
// head dim is a multiple of 32; and the pieces the AMX tile path (attention_amx.h) shares with it. Included by
// paged_attention.cpp only where the compiler targets AVX512-BF16.
//
// The fp32 vector path (attention_tiles.h) widens every key and value to fp32 and spends one FMA per
// product: ~230 GFLOP/s on two AVX512-BF16 cores, a third of their bf16 matmul peak, so attention over a
// cached context was most of a prefill step's excess over its linears (a 512-token chunk over 512 cached
// tokens: 110 ms of 30 layers' attention). Here a head's keys and values are copied once as bf16 pairs
// (the order AMX's B tiles take, which also puts each VDPBF16PS operand in one load; one pack per KV head that
// all of a sequence's row blocks share, paged_attention.cpp), and a block of kRows query vectors is scored 32
// keys at a time by VDPBF16PS, two products per lane, every register block going over a stretch of keys that
// stays in L2 before the next stretch. The online softmax runs in fp32 (in log2 units); the probabilities,
// rounded to bf16 (as flash attention does on GPUs, and the tile path here), weigh V by VDPBF16PS as well.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "online_softmax.h"

namespace attn_bf16 {

constexpr int64_t kKeys = 32;  // keys per block (P's A tile on AMX: 16 query vectors x 32 keys)

// Per-thread scratch, grown to the largest item.
struct Scratch {
  std::vector<uint32_t> kb, vb;  // packed keys / values, bf16 pairs (an item's own)
  std::vector<uint16_t> qa;      // queries, bf16
  std::vector<int64_t> off;      // each key's slot, in elements
  std::vector<int64_t> span;     // item: each register block's first and last key block
  std::vector<float> lv;         // item: each query vector's denominator, per lane, between stretches
  // The packed keys and values the next item reads: kb / vb, or a pack its sequence's items share.
  const uint32_t* kbp = nullptr;
  const uint32_t* vbp = nullptr;
};

inline int64_t packed_elems(int64_t n, int64_t D) { return (n + kKeys - 1) / kKeys * kKeys * D / 2; }

// The scores are kept in log2 units (the queries are scaled by log2 e, `queries`), so a probability is 2^(s - max):
// no multiply per score. 2^x for x <= 0 by rounding x to the nearest integer n (VSCALEFPS applies 2^n) and a
// degree-4 polynomial for 2^f, f in [-1/2, 1/2] (relative error 2.7e-6, against bf16's rounding step of 2^-8 the
// probabilities are stored with). `x` must be finite or the lanes' result is ignored (masked off afterwards).
constexpr float kLog2e = 1.44269504088896341f, kLn2 = 0.693147180559945309f;
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.560510516166687e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591703951358795e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402498126029968e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931219696998596e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999991655349731e-1f));
  return _mm512_scalef_ps(p, n);
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
//   kb: [16-key group][D/32][16 pairs of dims][16 keys] (pairs of bf16 as one uint32);
//   vb: [32-key block][D/16][16 pairs of keys][16 dims].
// This writes keys jb..je - 1 of them (multiples of 32; je at most the padded end) into kb / vb, each
// packed_elems(n, D) long, so that several threads can pack one head's keys.
inline void pack_range(const uint16_t* k0, const uint16_t* v0, const int64_t* table, int64_t block_size,
                       int64_t slot_stride, int64_t first, int64_t n, int64_t jb, int64_t je, int64_t D, uint32_t* kb,
                       uint32_t* vb, std::vector<int64_t>& off) {
  const int64_t dc = D / 32, dv = D / 16, real = std::min(n, je);
  off.resize(je - jb);
  for (int64_t j = jb, b = (first + jb) / block_size, i = (first + jb) % block_size; j < real; ++j) {  // no division per key
    off[j - jb] = (table[b] * block_size + i) * slot_stride;
    if (++i == block_size) {
      i = 0;
      ++b;
    }
  }
  const int64_t* o = off.data() - jb;
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t j0 = jb; j0 < je; j0 += 16) {
    for (int64_t c = 0; c < dc; ++c) {
      __m512i r[16];
      for (int64_t j = 0; j < 16; ++j) r[j] = j0 + j < n ? _mm512_loadu_si512(k0 + o[j0 + j] + c * 32) : zero;
      transpose16(r);
      uint32_t* kt = kb + ((j0 / 16) * dc + c) * 256;
      for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(kt + p * 16, r[p]);
    }
  }
  // A pair of keys' values interleaved: the low half of each uint32 from the even key.
  for (int64_t j = jb; j < je; j += 2) {
    uint32_t* vbk = vb + (j / kKeys) * dv * 256 + ((j % kKeys) / 2) * 16;
    for (int64_t c = 0; c < dv; ++c) {
      const __m512i even =
          j < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + o[j] + c * 16)))
                : zero;
      const __m512i odd =
          j + 1 < n ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + o[j + 1] + c * 16)))
                    : zero;
      _mm512_storeu_si512(vbk + c * 256, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
    }
  }
}

// An item's own pack of all n keys, in s.kb / s.vb, which the item then reads.
inline void pack(const uint16_t* k0, const uint16_t* v0, const int64_t* table, int64_t block_size,
                 int64_t slot_stride, int64_t first, int64_t n, int64_t D, Scratch& s) {
  const int64_t elems = packed_elems(n, D);
  s.kb.resize(elems);
  s.vb.resize(elems);
  pack_range(k0, v0, table, block_size, slot_stride, first, n, 0, elems * 2 / D, D, s.kb.data(), s.vb.data(), s.off);
  s.kbp = s.kb.data();
  s.vbp = s.vb.data();
}

// qa = the nq query vectors of qf [nq][D] (fp32, scaled) times log2 e, in bf16, zero vectors up to nqp: the scores
// come out in log2 units (exp2_nonpositive); `natural_max` takes the running maxima back to the caller's units.
inline void queries(const float* qf, int64_t nq, int64_t nqp, int64_t D, Scratch& s) {
  s.qa.resize(nqp * D);
  const __m512 log2e = _mm512_set1_ps(kLog2e);
  for (int64_t i = 0; i < nq * D; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.qa.data() + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(qf + i), log2e)));
  std::fill(s.qa.begin() + nq * D, s.qa.begin() + nqp * D, 0);
}

// The nq running maxima from log2 units back to natural ones (-inf stays).
inline void natural_max(float* m, int64_t nq) {
  for (int64_t i = 0; i < nq; ++i) m[i] *= kLn2;
}

// The online softmax's step over one block of 32 keys t0.. for NR query vectors rb.. (the first `rows` real,
// the rest padding): scores sc (log2 units) -> probabilities p rounded to bf16 (0 where a vector does not see
// the key: causal, then the window's first key), each vector's running max m moved where a score passes it, its
// denominator kept per lane in lv (corr[r] applied), corr[r] the factor its sums so far must shrink by.
// Returns whether any corr[r] differs from 1. Most blocks of a long context are seen whole by every vector of
// the register block: those skip the masks (the softmax is a third of the work beside the products).
template <int NR>
inline bool softmax_block(const float (*sc)[kKeys], int64_t rb, int64_t rows, int64_t t0, const int64_t* qpos,
                          const int64_t* qlo, float* m, __m512* lv, uint16_t (*p)[kKeys], float* corr) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // The denominator sums the probabilities as rounded, the values they weigh V with: VDPBF16PS against ones
  // adds them in pairs, exactly.
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);
  bool whole = rows == NR;
  for (int64_t r = 0; r < NR && whole; ++r) whole = qlo[rb + r] <= t0 && qpos[rb + r] >= t0 + kKeys - 1;
  bool rescale = false;
  for (int64_t r = 0; r < NR; ++r) {
    const int64_t qi = rb + r;
    corr[r] = 1.f;
    __m512 s0 = _mm512_load_ps(sc[r]), s1 = _mm512_load_ps(sc[r] + 16);
    __mmask16 k0 = 0xFFFF, k1 = 0xFFFF;
    if (!whole) {
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
      k0 = seen(0);
      k1 = seen(16);
      s0 = _mm512_mask_blend_ps(k0, neg_inf, s0);
      s1 = _mm512_mask_blend_ps(k1, neg_inf, s1);
    }
    // The max moves only where a score passes it (rarely, once past the first blocks): a compare per
    // row instead of a horizontal max.
    const __m512 mold = _mm512_set1_ps(m[qi]);
    const bool up = (_mm512_cmp_ps_mask(s0, mold, _CMP_GT_OQ) | _mm512_cmp_ps_mask(s1, mold, _CMP_GT_OQ)) != 0;
    const float mx = up ? _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)) : m[qi];
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 e0, e1;
    if (whole) {  // every score finite
      e0 = exp2_nonpositive(_mm512_sub_ps(s0, mv));
      e1 = exp2_nonpositive(_mm512_sub_ps(s1, mv));
    } else {  // unseen keys' -inf held off the polynomial, their lanes zeroed
      const __m512 lo = _mm512_set1_ps(-126.f);
      e0 = _mm512_maskz_mov_ps(k0, exp2_nonpositive(_mm512_max_ps(_mm512_sub_ps(s0, mv), lo)));
      e1 = _mm512_maskz_mov_ps(k1, exp2_nonpositive(_mm512_max_ps(_mm512_sub_ps(s1, mv), lo)));
    }
    const __m512i pw = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);
    _mm512_store_si512(p[r], pw);
    if (mx != m[qi] && m[qi] != -std::numeric_limits<float>::infinity()) {
      corr[r] = std::exp2(m[qi] - mx);
      rescale = true;
      lv[r] = _mm512_mul_ps(lv[r], _mm512_set1_ps(corr[r]));
    }
    // Kept per lane, summed across lanes once per row block.
    lv[r] = _mm512_dpbf16_ps(lv[r], (__m512bh)pw, ones);
    m[qi] = mx;
  }
  return rescale;
}

// Query vectors per register block: R x 2 score accumulators, R x 2 of the output sums.
constexpr int kRows = 8;
// Key blocks per stretch of `item`: 256 keys, 64 KiB of packed keys and values at a head dim of 64.
constexpr int64_t kStretchBlocks = 8;

// sc[r][j] = q[r] . K[j] for the R vectors at q (bf16 pairs, D / 2 per vector) and the 32 keys of one block
// (kb's two 16-key groups at k, each dc * 256 pairs long).
template <int R>
inline void score(const uint32_t* q, int64_t D, const uint32_t* k, int64_t dc, float (*sc)[kKeys]) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint32_t* k1 = k + dc * 256;
  for (int64_t c = 0; c < dc; ++c)
    for (int64_t pp = 0; pp < 16; ++pp) {
      const __m512bh a = (__m512bh)_mm512_loadu_si512(k + c * 256 + pp * 16);
      const __m512bh b = (__m512bh)_mm512_loadu_si512(k1 + c * 256 + pp * 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * D / 2 + c * 16 + pp]));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, a);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b);
      }
    }
  for (int r = 0; r < R; ++r) {
    _mm512_store_ps(sc[r], acc[r][0]);
    _mm512_store_ps(sc[r] + 16, acc[r][1]);
  }
}

// a[r][c0 * 16 .. (c0 + 2) * 16) += P[r] V over one block of 32 keys (vb's [D/16][16 pairs][16 dims] at v).
template <int R>
inline void weigh(const uint16_t (*p)[kKeys], const uint32_t* v, int64_t c0, float* a, int64_t D) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) acc[r][c] = _mm512_loadu_ps(a + r * D + (c0 + c) * 16);
  for (int64_t pp = 0; pp < 16; ++pp) {
    const __m512bh v0 = (__m512bh)_mm512_loadu_si512(v + c0 * 256 + pp * 16);
    const __m512bh v1 = (__m512bh)_mm512_loadu_si512(v + (c0 + 1) * 256 + pp * 16);
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, p[r] + 2 * pp, sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, v0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, v1);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 2; ++c) _mm512_storeu_ps(a + r * D + (c0 + c) * 16, acc[r][c]);
}

// One item: nq query vectors qf [nq][D] (fp32, scaled) over the keys first.. packed by `pack`, vector qi
// seeing keys qlo[qi]..qpos[qi]. Leaves the running max m, the denominator l and the unnormalized sums acc
// ([ceil(nq / kRows) * kRows][D]: rows past nq are scratch) as the fp32 path does.
inline void item(const float* qf, int64_t nq, const int64_t* qpos, const int64_t* qlo, int64_t first, int64_t D,
                 Scratch& s, float* m, float* l, float* acc) {
  constexpr int R = kRows;
  const int64_t nqp = (nq + R - 1) / R * R, dc = D / 32, dv = D / 16, nrb = nqp / R;
  queries(qf, nq, nqp, D, s);
  std::fill(acc, acc + nqp * D, 0.f);
  const uint32_t* qa = reinterpret_cast<const uint32_t*>(s.qa.data());
  alignas(64) float sc[R][kKeys];
  alignas(64) uint16_t p[R][kKeys];
  float corr[R];
  __m512 lv[R];
  // Each register block's key blocks, [lo, hi] relative to `first`.
  s.span.resize(2 * nrb);
  s.lv.resize(nqp * 16);
  std::fill(s.lv.begin(), s.lv.end(), 0.f);
  int64_t b_lo = std::numeric_limits<int64_t>::max(), b_hi = -1;
  for (int64_t rb = 0; rb < nqp; rb += R) {
    const auto [lo, hi] = start_rows(qpos, qlo, rb, std::min<int64_t>(R, nq - rb), m, l);
    s.span[2 * (rb / R)] = (lo - first) / kKeys;
    s.span[2 * (rb / R) + 1] = (hi - first) / kKeys;
    b_lo = std::min(b_lo, (lo - first) / kKeys);
    b_hi = std::max(b_hi, (hi - first) / kKeys);
  }
  // A stretch of keys at a time for every register block: the stretch's packed keys and values stay in L2,
  // where each register block reading the whole context in turn streamed it from L3 or memory once per block.
  // The running maxima and sums stay in memory between stretches (m, acc, s.lv).
  for (int64_t c0 = b_lo; c0 <= b_hi; c0 += kStretchBlocks) {
    const int64_t c1 = std::min(b_hi, c0 + kStretchBlocks - 1);
    for (int64_t rb = 0; rb < nqp; rb += R) {
      const int64_t k0 = std::max(c0, s.span[2 * (rb / R)]), k1 = std::min(c1, s.span[2 * (rb / R) + 1]);
      if (k0 > k1) continue;
      const int64_t rows = std::min<int64_t>(R, nq - rb);
      float* a = acc + rb * D;
      for (int r = 0; r < R; ++r) lv[r] = _mm512_loadu_ps(s.lv.data() + (rb + r) * 16);
      for (int64_t blk = k0; blk <= k1; ++blk) {
        score<R>(qa + rb * D / 2, D, s.kbp + 2 * blk * dc * 256, dc, sc);
        if (softmax_block<R>(sc, rb, rows, first + blk * kKeys, qpos, qlo, m, lv, p, corr))
          for (int r = 0; r < R; ++r)
            if (corr[r] != 1.f)
              for (int64_t i = 0; i < D; i += 16)
                _mm512_storeu_ps(a + r * D + i, _mm512_mul_ps(_mm512_loadu_ps(a + r * D + i), _mm512_set1_ps(corr[r])));
        for (int64_t d0 = 0; d0 < dv; d0 += 2) weigh<R>(p, s.vbp + blk * dv * 256, d0, a, D);
      }
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(s.lv.data() + (rb + r) * 16, lv[r]);
    }
  }
  for (int64_t r = 0; r < nq; ++r) l[r] = _mm512_reduce_add_ps(_mm512_loadu_ps(s.lv.data() + r * 16));
  natural_max(m, nq);
}

}  // namespace attn_bf16
