// Keys and values packed once per KV head for all of a sequence's row blocks (paged_attention.cpp's many-row
// items on the bf16 paths). Each item packing its own keys re-read the whole context from memory per row block: a
// 512-row chunk at 8k tokens made 24 packs of 2 MiB, an eighth of the call. Here a sequence whose rows span several
// row blocks gets one pack per KV head, written by every thread a stretch of keys (`pack`, before the items run),
// and its items read it (`use`). Included where the build targets AVX512-BF16 (attention_bf16.h's packing).
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "attention_bf16.h"

namespace attn_bf16 {

constexpr int64_t kPackStretch = 256;  // keys per packing job

class SharedPacks {
 public:
  explicit SharedPacks(int64_t seqs) : seq_count_(seqs) {}

  // Keys first..last of sequence `seq`, for each of its KV heads (call in sequence order, then `place`).
  void add(int64_t seq, int64_t kv_heads, int64_t first, int64_t last, int64_t D) {
    if (of_.empty()) of_.assign(static_cast<size_t>(seq_count_) * kv_heads, -1);
    const int64_t n = last + 1 - first, padded = (n + kKeys - 1) / kKeys * kKeys;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const int64_t i = static_cast<int64_t>(packs_.size());
      of_[seq * kv_heads + h] = i;
      for (int64_t jb = 0; jb < padded; jb += kPackStretch) jobs_.push_back({i, jb, std::min(padded, jb + kPackStretch)});
      packs_.push_back({seq, h, first, n, elems_});
      elems_ += 2 * static_cast<size_t>(packed_elems(n, D));
    }
  }

  // The packs' memory: kept between calls (the calling thread's), since a fresh multi-MiB allocation a layer would
  // fault its pages in each time.
  void place() {
    thread_local std::vector<uint32_t> store;
    if (store.size() < elems_) store.resize(elems_);
    for (auto& p : packs_) p.kb = store.data() + p.offset;
  }

  size_t jobs() const { return jobs_.size(); }

  // Packing job j: a stretch of one pack's keys from the caches (k0 / v0: the caches' first element).
  void pack(size_t j, const uint16_t* k0, const uint16_t* v0, const int64_t* tables, int64_t nblk, int64_t block_size,
            int64_t slot_stride, int64_t D, std::vector<int64_t>& off) const {
    const auto [i, jb, je] = jobs_[j];
    const Pack& p = packs_[i];
    pack_range(k0 + p.head * D, v0 + p.head * D, tables + p.seq * nblk, block_size, slot_stride, p.first, p.n, jb, je,
               D, p.kb, p.kb + packed_elems(p.n, D), off);
  }

  // Points s at the pack of (seq, head) and sets `first` to its first key; false where the sequence has none.
  bool use(int64_t seq, int64_t head, int64_t kv_heads, int64_t D, Scratch& s, int64_t& first) const {
    const int64_t i = of_.empty() ? -1 : of_[seq * kv_heads + head];
    if (i < 0) return false;
    const Pack& p = packs_[i];
    first = p.first;
    s.kbp = p.kb;
    s.vbp = p.kb + packed_elems(p.n, D);
    return true;
  }

 private:
  // One KV head's keys first..first + n - 1 of sequence `seq`: kb, then the values right after.
  struct Pack {
    int64_t seq, head, first, n;
    size_t offset;  // into the store
    uint32_t* kb = nullptr;
  };
  int64_t seq_count_;
  std::vector<Pack> packs_;
  std::vector<int64_t> of_;                     // seq * kv_heads + head -> pack, or -1
  std::vector<std::array<int64_t, 3>> jobs_;  // (pack, first key, end key), relative to the pack's first
  size_t elems_ = 0;
};

}  // namespace attn_bf16
