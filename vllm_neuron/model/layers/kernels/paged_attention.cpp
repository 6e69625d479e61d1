// Paged attention for CPU over the KV cache, for prefill and decode alike.
//
// Every query row belongs to one sequence (rows of sequence s are query_start[s]..query_start[s+1])
// and attends causally to that sequence's keys 0..positions[row], read in place through the
// sequence's block table. Its own new K/V must already be in the cache. Only real keys are visited,
// whatever the context bucket, and nothing is gathered. Rows outside every sequence (padding) get 0.
//
// A sliding window (window > 0) narrows a row's keys to the `window` most recent positions, itself
// included: keys before positions[row] - window + 1 are never read (a sliding-window KV group has
// given their blocks back, its table holds the null block there). Attention sinks (one logit per query
// head, gpt-oss) join each row's softmax denominator and contribute no value.
//
// Work item = (sequence, KV head, block of query rows): the rows' G query heads sharing the KV head form
// one query tile, scored against kTile keys at a time (keys transposed, so the inner loop runs across
// keys with no horizontal reduction) with an online softmax (flash attention). A decode row, when the batch
// has sequences enough for every thread, takes all KV heads in one item instead: a cache slot holds the
// heads side by side, and one stream per sequence read whole ran faster than KV interleaved ones (16
// sequences at 1,000 keys, 30 layers: 33 vs 39-53 ms on an AMX Xeon). Where the build has vector
// intrinsics, many-row items widen their keys to fp32 once and score and weigh a few query rows per
// register block (attention_tiles.h); decode items read keys and values in place (attention_decode.h). On
// AMX, many-row items of a bf16 cache run on tiles instead (attention_amx.h).
// The ATen headers used, not ATen/ATen.h: parsing all of that doubles the first start's kernel build.
#include <ATen/Dispatch.h>
#include "op_table.h"
#include <ATen/Parallel.h>
#include <omp.h>

#include "attention_split.h"
#include "cache_elems.h"
#include "online_softmax.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define VN_ATTENTION_TILES 1
#include "attention_tiles.h"
#include "attention_decode.h"
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define VN_ATTENTION_BF16 1
#include "attention_bf16.h"
#include "attention_shared_packs.h"
#endif
#if defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define VN_ATTENTION_AMX 1
#include "attention_amx.h"
#endif
#include "attention_fp32_tiles.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kRowBlock = 8;  // the fewest query rows per item
constexpr int64_t kMaxRowBlock = 64;
constexpr int64_t kVInL2Bytes = 192 << 10;  // per item, a fraction of a thread's L2 (>= 512 KiB on these CPUs)

// Query rows row0.. of sequence `seq`, KV heads head..head + heads - 1 (several heads only for a decode row
// read in place: a slot holds every head's key side by side, so one item reads each slot whole).
struct Item {
  int64_t seq, head, row0, rows, heads = 1;
  int64_t part = 0;  // of a decode row's keys split into stretches (attention_kernel's `parts`), merged afterwards
};

// The keys a query row at position `pos` sees: [first, last] (its window's start, or 0; its position, clamped
// into the table's keys).
inline std::pair<int64_t, int64_t> row_keys(int64_t pos, int64_t window, int64_t max_keys) {
  const int64_t last = std::min<int64_t>(std::max<int64_t>(pos, 0), max_keys - 1);
  return {window > 0 ? std::max<int64_t>(0, last - window + 1) : 0, last};
}

// Sinks: the softmax over [scores, sink] with the sink's column dropped. acc / l hold sums relative to the
// running max m; bring them to max(m, sink) and add the sink's term to the denominator.
inline void add_sinks(const float* sinks, const Item& w, int64_t G, int64_t D, int64_t nq, const float* m, float* l,
                      float* acc) {
  if (sinks == nullptr) return;
  for (int64_t qi = 0; qi < nq; ++qi) {
    const float s = sinks[w.head * G + qi % (G * w.heads)];
    const float mx = m[qi] > s ? m[qi] : s;
    const float corr = exp_nonpositive(m[qi] - mx);
    l[qi] = l[qi] * corr + exp_nonpositive(s - mx);
    float* a = acc + qi * D;
    for (int64_t i = 0; i < D; ++i) a[i] *= corr;
  }
}

template <typename T>
inline void store_rows(T* op, const float* acc, const float* l, const Item& w, int64_t H, int64_t G, int64_t D,
                       float v_mul) {
  for (int64_t r = 0; r < w.rows; ++r)
    for (int64_t g = 0; g < G * w.heads; ++g) {
      const int64_t qi = r * G * w.heads + g;
      const float inv = v_mul / l[qi];
      T* dst = op + ((w.row0 + r) * H + w.head * G + g) * D;
      for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[qi * D + i] * inv);
    }
}

// How many-row items of a bf16 cache with this head dim run here: 2 on AMX tiles (the build targets AMX-BF16
// and the OS hands out tile state), 1 by bf16 dot products in vector registers (AVX512-BF16), 0 in fp32.
int64_t bf16_path(int64_t head_dim) {
  if (head_dim % 32 != 0) return 0;  // both bf16 paths take whole blocks of 32 dims
#ifdef VN_ATTENTION_AMX
  if (amx::tiles_permitted()) return 2;
#endif
#ifdef VN_ATTENTION_BF16
  return 1;
#else
  return 0;
#endif
}

// C: the cache's element type (T, or FP8 holding K / k_mul and V / v_mul: k_mul folds into the query
// scale, v_mul into the softmax normalization).
template <typename T, typename C = T>
void attention_kernel(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& block_tables, const at::Tensor& query_start,
                      const at::Tensor& positions, double scale, int64_t block_size, at::Tensor& out,
                      const float* sinks, int64_t window, float k_mul = 1.f, float v_mul = 1.f) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KV = k_cache.size(1), G = H / KV;
  const int64_t S = block_tables.size(0), nblk = block_tables.size(1);
  const T* qp = q.data_ptr<T>();
  const C* kp = reinterpret_cast<const C*>(k_cache.data_ptr());
  const C* vp = reinterpret_cast<const C*>(v_cache.data_ptr());
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale) * k_mul;
  const int64_t slot_stride = KV * D, max_keys = nblk * block_size;

  // Many-row items of a bf16 cache on AMX tiles where the build and the OS allow them (attention_amx.h), else by
  // bf16 dot products in vector registers on AVX512-BF16 builds (attention_bf16.h).
  bool amx_rows = false, dot_rows = false;
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) {
    const int64_t path = bf16_path(D);
    amx_rows = path == 2;
    dot_rows = path == 1;
  }
  // Bigger row blocks spread widening each key to fp32 (once per item) over more query rows; enough
  // items stay for every thread to take several (causal work grows along a sequence; dynamic schedule).
  int64_t rows_total = 0;
  for (int64_t s = 0; s < S; ++s)
    rows_total += std::max<int64_t>(0, std::min<int64_t>(N, qs[s + 1]) - std::max<int64_t>(0, qs[s]));
  int64_t row_block =
      std::clamp<int64_t>(rows_total * KV / (4 * std::max(1, at::get_num_threads())), kRowBlock, kMaxRowBlock);
  // On both bf16 paths every item packs its keys once, so fewer and bigger items: 16 query rows or more
  // (whole tiles of 16 query vectors, whatever G), about two per thread.
  if (amx_rows || dot_rows)
    row_block = std::clamp<int64_t>(rows_total * KV / (2 * std::max(1, at::get_num_threads())) / 16 * 16, 16,
                                    kMaxRowBlock);
  // A decode row read in place takes all KV heads in one item (each slot read whole, one stream per
  // sequence rather than KV interleaved ones) when there are sequences enough to keep every thread busy.
  int64_t single_rows = 0;
  for (int64_t s = 0; s < S; ++s) single_rows += std::min<int64_t>(N, qs[s + 1]) - std::max<int64_t>(0, qs[s]) == 1;
  bool slots_in_place = false;
  const int64_t threads = std::max(1, at::get_num_threads());
#ifdef VN_ATTENTION_TILES
  if constexpr (attn_decode::kReadInPlace<C>) slots_in_place = D % vn_simd::Vec::W == 0;
#endif
  const bool whole_slots = slots_in_place && single_rows >= 2 * threads;
  // Fewer decode rows than that split along their keys (attention_split.h), stretches of whole slots where
  // the cache is read in place.
  int64_t parts = 1;
  if (!whole_slots && window == 0) {
    int64_t keys = 0;
    for (int64_t r = 0; r < N; ++r) keys = std::max(keys, pos[r] + 1);
    parts = attn_split::parts(threads, single_rows, rows_total, slots_in_place ? 1 : KV, keys);
  }
  const bool split_whole = parts > 1 && slots_in_place;
  std::vector<Item> items;
  std::vector<char> covered(N, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t lo = std::max<int64_t>(0, qs[s]), hi = std::min<int64_t>(N, qs[s + 1]);
    for (int64_t r = lo; r < hi; ++r) covered[r] = 1;
    if (whole_slots && hi - lo == 1) {
      items.push_back({s, 0, lo, 1, KV});
      continue;
    }
    if (parts > 1) {  // every row here is a decode row (single_rows == rows_total)
      if (split_whole) {
        for (int64_t part = 0; part < parts; ++part) items.push_back({s, 0, lo, 1, KV, part});
      } else {
        for (int64_t h = 0; h < KV; ++h)
          for (int64_t part = 0; part < parts; ++part) items.push_back({s, h, lo, 1, 1, part});
      }
      continue;
    }
    for (int64_t r0 = lo; r0 < hi; r0 += row_block)
      for (int64_t h = 0; h < KV; ++h) items.push_back({s, h, r0, std::min<int64_t>(row_block, hi - r0)});
  }
  for (int64_t r = 0; r < N; ++r)
    if (!covered[r]) std::fill(op + r * H * D, op + (r + 1) * H * D, static_cast<T>(0.f));

  const int64_t n_items = static_cast<int64_t>(items.size());
  const int64_t part_nq = split_whole ? H : G, part_stride = attn_split::stride(part_nq, D);
  std::vector<float> partial(parts > 1 ? n_items * part_stride : 0);
#ifdef VN_ATTENTION_BF16
  // A sequence whose rows span several row blocks shares one pack of its keys per KV head (attention_shared_packs.h).
  attn_bf16::SharedPacks shared(S);
  if (amx_rows || dot_rows) {
    for (int64_t s = 0; s < S; ++s) {
      const int64_t lo = std::max<int64_t>(0, qs[s]), hi = std::min<int64_t>(N, qs[s + 1]);
      if (hi - lo <= row_block || (whole_slots && hi - lo == 1) || parts > 1) continue;
      int64_t first = max_keys, last = 0;
      for (int64_t r = lo; r < hi; ++r) {
        const auto [a, b] = row_keys(pos[r], window, max_keys);
        first = std::min(first, a);
        last = std::max(last, b);
      }
      shared.add(s, KV, first, last, D);
    }
    shared.place();
  }
#endif
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int64_t nq_max = std::max(row_block, whole_slots || split_whole ? KV : 1) * G;
    // acc: whole blocks of 16 query vectors for the tile path.
    std::vector<float> qf(nq_max * D), acc((nq_max + 15) / 16 * 16 * D), kt(D * kTile), vt(kTile * D);
    std::vector<float> m(nq_max), l(nq_max), p(nq_max * kTile), scores;
    std::vector<int64_t> qpos(nq_max), qlo(nq_max), slots;
#ifdef VN_ATTENTION_BF16
    attn_bf16::Scratch bf16_scratch;
    if (shared.jobs() > 0) {
#pragma omp for schedule(dynamic, 1)
      for (size_t j = 0; j < shared.jobs(); ++j)
        shared.pack(j, reinterpret_cast<const uint16_t*>(kp), reinterpret_cast<const uint16_t*>(vp), bt, nblk,
                    block_size, slot_stride, D, bf16_scratch.off);
      // (the loop's barrier: every pack is whole before any item reads it)
    }
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < n_items; ++it) {
      const Item& w = items[it];
      const int64_t nq = w.rows * G * w.heads;
      const int64_t* table = bt + w.seq * nblk;
      int64_t last = 0, first = max_keys;  // keys first..last are visited
      for (int64_t r = 0; r < w.rows; ++r) {
        const int64_t row = w.row0 + r;
        const auto [lo, pr] = row_keys(pos[row], window, max_keys);
        last = std::max(last, pr);
        first = std::min(first, lo);
        for (int64_t g = 0; g < G * w.heads; ++g) {
          const int64_t qi = r * G * w.heads + g;
          const T* src = qp + (row * H + w.head * G + g) * D;
          for (int64_t i = 0; i < D; ++i) qf[qi * D + i] = to_f(src[i]) * fscale;
          qpos[qi] = pr;
          qlo[qi] = lo;
        }
      }
      if (w.rows == 1) {
        // Decode: one pass to score every key, an exact softmax, one pass over V (cheaper than the
        // online softmax's per-tile rescaling when there is a single query row). Scores of keys
        // first..last are kept at 0..len.
        float* part_out = parts > 1 ? partial.data() + it * part_stride : nullptr;
        if (part_out && !attn_split::narrow(first, last, w.part, parts)) {
          attn_split::store_empty(part_out, nq, D);
          continue;
        }
        const int64_t len = last + 1 - first;
        scores.resize(nq * len);
        bool in_place = false;  // keys and values read where they lie, widened in registers
#ifdef VN_ATTENTION_TILES
        // Each key's slot offset, worked out once per item block by block: the passes look a key up
        // several times (prefetch, keys, values), and a division by the block size per lookup took a third
        // of a batch-1 call's time.
        slots.resize(len);
        for (int64_t t = first; t <= last;) {
          const int64_t b = t / block_size, end = std::min(last + 1, (b + 1) * block_size);
          for (int64_t o = (table[b] * block_size + t - b * block_size) * slot_stride; t < end; ++t, o += slot_stride)
            slots[t - first] = o;
        }
        const int64_t* sl = slots.data() - first;
        const auto slot_at = [sl](int64_t t) { return sl[t]; };
        if constexpr (attn_decode::kReadInPlace<C>) {
          in_place = D % vn_simd::Vec::W == 0;
          if (in_place)
            // An item's V rows (len x D), when they fit kVInL2Bytes, are fetched alongside K, so the values
            // pass reads cache rather than starting a second stream from memory (longer: no gain measured).
            attn_decode::decode_scores(qf.data(), w.heads, G, D, kp + w.head * D, slot_at, first, last,
                                       scores.data(),
                                       len * w.heads * D * int64_t(sizeof(C)) <= kVInL2Bytes ? vp + w.head * D : nullptr);
        }
#endif
        for (int64_t t0 = first; !in_place && t0 <= last; t0 += kTile) {
          const int64_t n = std::min<int64_t>(kTile, last + 1 - t0);
          load_k_tile(kp, table, block_size, slot_stride, w.head * D, D, t0, n, kt.data());
          for (int64_t g = 0; g < G; ++g) {
            float sc[kTile] = {0.f};
            score_tile(qf.data() + g * D, kt.data(), D, sc);
            std::copy(sc, sc + n, scores.data() + g * len + (t0 - first));
          }
        }
        std::fill(acc.begin(), acc.begin() + nq * D, 0.f);
        for (int64_t g = 0; g < nq; ++g) {
          float* sg = scores.data() + g * len;
          float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
          for (int64_t t = 0; t < len; ++t) mx = sg[t] > mx ? sg[t] : mx;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < len; ++t) {
            sg[t] = exp_nonpositive(sg[t] - mx);
            sum += sg[t];
          }
          l[g] = sum;
          m[g] = mx;
        }
#ifdef VN_ATTENTION_TILES
        if constexpr (attn_decode::kReadInPlace<C>) {
          for (int64_t h = 0; in_place && h < w.heads; ++h)
            attn_decode::decode_values(scores.data() + h * G * len, G, len, first, vp + (w.head + h) * D, slot_at,
                                       D, acc.data() + h * G * D);
        }
#endif
        for (int64_t t = 0; !in_place && t < len; ++t) {
          const C* vs = vp + slot_of(table, block_size, t + first) * slot_stride + w.head * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) vt[i] = to_f(vs[i]);
          for (int64_t g = 0; g < G; ++g) {
            const float pg = scores[g * len + t];
            float* a = acc.data() + g * D;
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) a[i] += pg * vt[i];
          }
        }
        if (part_out) {
          attn_split::store(part_out, nq, D, m.data(), l.data(), acc.data());
          continue;
        }
        add_sinks(sinks, w, G, D, nq, m.data(), l.data(), acc.data());
        store_rows(op, acc.data(), l.data(), w, H, G, D, v_mul);
        continue;
      }
#ifdef VN_ATTENTION_BF16
      if (amx_rows || dot_rows) {
        if (!shared.use(w.seq, w.head, KV, D, bf16_scratch, first)) {
          attn_bf16::pack(reinterpret_cast<const uint16_t*>(kp + w.head * D),
                          reinterpret_cast<const uint16_t*>(vp + w.head * D), table, block_size, slot_stride, first,
                          last + 1 - first, D, bf16_scratch);
        }
#ifdef VN_ATTENTION_AMX
        if (amx_rows)
          attn_amx::item(qf.data(), nq, qpos.data(), qlo.data(), first, D, bf16_scratch, m.data(), l.data(), acc.data());
#endif
        if (dot_rows)
          attn_bf16::item(qf.data(), nq, qpos.data(), qlo.data(), first, D, bf16_scratch, m.data(), l.data(), acc.data());
        add_sinks(sinks, w, G, D, nq, m.data(), l.data(), acc.data());
        store_rows(op, acc.data(), l.data(), w, H, G, D, v_mul);
        continue;
      }
#endif
#ifdef VN_ATTENTION_TILES
      if (D % vn_simd::Vec::W == 0) {
        tiled_item(qf.data(), nq, qpos.data(), qlo.data(), first, last, kp, vp, table, block_size, slot_stride,
                   w.head * D, D, kt, vt, m.data(), l.data(), acc.data());
        add_sinks(sinks, w, G, D, nq, m.data(), l.data(), acc.data());
        store_rows(op, acc.data(), l.data(), w, H, G, D, v_mul);
        continue;
      }
#endif
      std::fill(acc.begin(), acc.begin() + nq * D, 0.f);
      std::fill(m.begin(), m.begin() + nq, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + nq, 0.f);
      for (int64_t t0 = first; t0 <= last; t0 += kTile) {
        const int64_t n = std::min<int64_t>(kTile, last + 1 - t0);
        load_k_tile(kp, table, block_size, slot_stride, w.head * D, D, t0, n, kt.data());
        load_v_tile(vp, table, block_size, slot_stride, w.head * D, D, t0, n, vt.data());
        for (int64_t qi = 0; qi < nq; ++qi) {
          float sc[kTile] = {0.f};
          score_tile(qf.data() + qi * D, kt.data(), D, sc);
          const int64_t visible = std::min<int64_t>(n, qpos[qi] - t0 + 1);  // causal: keys <= position
          const int64_t j0 = std::max<int64_t>(0, qlo[qi] - t0);  // the window: keys >= its first
          if (visible <= j0) continue;
          float mx = m[qi];
          for (int64_t j = j0; j < visible; ++j) mx = sc[j] > mx ? sc[j] : mx;
          const float corr = exp_nonpositive(m[qi] - mx);  // exp(-inf) -> 0 on the first tile
          float* pr = p.data() + qi * kTile;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j < kTile; ++j) {
            const float e = (j >= j0 && j < visible) ? exp_nonpositive(sc[j] - mx) : 0.f;
            pr[j] = e;
            sum += e;
          }
          l[qi] = l[qi] * corr + sum;
          m[qi] = mx;
          float* a = acc.data() + qi * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] *= corr;
          for (int64_t j = j0; j < visible; ++j) {
            const float pj = pr[j];
            const float* vrow = vt.data() + j * D;
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) a[i] += pj * vrow[i];
          }
        }
      }
      add_sinks(sinks, w, G, D, nq, m.data(), l.data(), acc.data());
      store_rows(op, acc.data(), l.data(), w, H, G, D, v_mul);
    }
    if (parts > 1) {  // after the loop's barrier
#pragma omp for schedule(static)
      for (int64_t grp = 0; grp < n_items / parts; ++grp) {
        const Item& w = items[grp * parts];
        attn_split::merge(partial.data() + grp * parts * part_stride, parts, part_nq, D, m.data(), l.data(),
                          acc.data());
        add_sinks(sinks, w, G, D, part_nq, m.data(), l.data(), acc.data());
        store_rows(op, acc.data(), l.data(), w, H, G, D, v_mul);
      }
    }
  }
}

// Checks shared by both ops, then the kernel for q's dtype and the cache's (q's own, or FP8).
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& positions,
                  double scale, int64_t block_size, const c10::optional<at::Tensor>& sinks, int64_t window,
                  float k_mul, float v_mul) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [N,H,D], caches [slots,KV,D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && query_start.scalar_type() == at::kLong &&
                  positions.scalar_type() == at::kLong,
              "block_tables, query_start and positions must be int64");
  TORCH_CHECK(query_start.size(0) == block_tables.size(0) + 1, "query_start must have one entry per sequence + 1");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  // What the loops index without further checks: head dims, one position per query row, the block
  // table's ids inside the pool.
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must have the same shape");
  TORCH_CHECK(q.size(2) == k_cache.size(2), "q's head dim must equal the caches' head dim");
  TORCH_CHECK(block_size > 0 && k_cache.size(0) % block_size == 0, "cache slots must be whole blocks");
  TORCH_CHECK(block_tables.dim() == 2 && query_start.dim() == 1 && positions.dim() == 1,
              "block_tables [S, n], query_start [S + 1], positions [N]");
  TORCH_CHECK(positions.size(0) == q.size(0), "positions must have one entry per query row");
  auto qc = q.contiguous();
  auto bt = block_tables.contiguous();
  {  // a plain loop: two ATen reductions and their .item() cost more than the check, 30 times a step
    const int64_t* ids = bt.data_ptr<int64_t>();
    const int64_t blocks = k_cache.size(0) / block_size;
    bool ok = true;
    for (int64_t i = 0; i < bt.numel(); ++i) ok &= ids[i] >= 0 && ids[i] < blocks;
    TORCH_CHECK(ok, "block ids must be in [0, number of cache blocks)");
  }
  auto qs = query_start.contiguous();
  auto ps = positions.contiguous();
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  at::Tensor sk;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(1), "sinks must hold one logit per query head");
    sk = sinks->to(at::kFloat).contiguous();
  }
  const float* sp = sinks.has_value() ? sk.data_ptr<float>() : nullptr;
  auto out = vn_ops::empty(qc.sizes(), qc.options());
  const auto ct = k_cache.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    if (ct == at::kFloat8_e4m3fn)
      attention_kernel<scalar_t, c10::Float8_e4m3fn>(qc, k_cache, v_cache, bt, qs, ps, scale, block_size, out, sp,
                                                     window, k_mul, v_mul);
    else if (ct == at::kFloat8_e5m2)
      attention_kernel<scalar_t, c10::Float8_e5m2>(qc, k_cache, v_cache, bt, qs, ps, scale, block_size, out, sp,
                                                   window, k_mul, v_mul);
    else
      attention_kernel<scalar_t>(qc, k_cache, v_cache, bt, qs, ps, scale, block_size, out, sp, window);
  });
  return out;
}

}  // namespace

at::Tensor vn_ops::paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& query_start,
                                   const at::Tensor& positions, double scale, int64_t block_size,
                                   const c10::optional<at::Tensor>& sinks, int64_t window) {
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the caches must share a dtype");
  return attend(q, k_cache, v_cache, block_tables, query_start, positions, scale, block_size, sinks, window, 1.f,
                1.f);
}

// The same over an FP8 cache (kv_cache_dtype fp8 / fp8_e4m3 / fp8_e5m2) holding K / k_scale, V / v_scale.
at::Tensor vn_ops::paged_attention_fp8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables, const at::Tensor& query_start,
                                       const at::Tensor& positions, double scale, int64_t block_size,
                                       const at::Tensor& k_scale, const at::Tensor& v_scale,
                                       const c10::optional<at::Tensor>& sinks, int64_t window) {
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK((ct == at::kFloat8_e4m3fn || ct == at::kFloat8_e5m2) && v_cache.scalar_type() == ct,
              "the caches must share an FP8 dtype (float8_e4m3fn or float8_e5m2)");
  TORCH_CHECK(k_scale.numel() == 1 && v_scale.numel() == 1, "k_scale and v_scale must hold one value each");
  return attend(q, k_cache, v_cache, block_tables, query_start, positions, scale, block_size, sinks, window,
                k_scale.to(at::kFloat).item<float>(), v_scale.to(at::kFloat).item<float>());
}

int64_t vn_ops::bf16_rows_path(int64_t head_dim) { return bf16_path(head_dim); }
