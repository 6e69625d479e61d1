"""KV block pool: free list in eviction order, reference counts and the hash -> block map.

Block 0 is the null block: never handed out, it absorbs the writes of padding tokens and stands in a
sliding-window group's table for the blocks that left the window (touch / release skip it). A freed block
that holds a hashed (full) prefix stays findable until it is reused, which is what makes prefix
caching survive a request's end; eviction takes the least recently freed block first.

Blocks never handed out yet are taken in id order. Where the runner backs the KV pool's memory on first use
(the CPU pool, worker/kv_prefault.py), it tells the pool how far its memory is backed (`set_backed`): a
never-used block below that line is taken first (it costs nothing and evicts nothing), then the least
recently freed block, and a block beyond the line only when no freed one is left. Backing a block's pages
is a fault per page, ~3 ms a block of the bundled model on a fresh VM: taken in id order the whole way, an
offline run paid for every block it ever used (64 requests: 13-16% of its time) where the blocks it holds
at once would do. Without a hint every block counts as backed (id order, then freed ones).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        # Cache keys are opaque: the KV cache manager uses (group, chained block hash).
        self.block_hash: list[Hashable | None] = [None] * num_blocks
        self.cached: dict[Hashable, int] = {}
        # Blocks handed out and freed since; insertion order is eviction order: the front is reused first.
        self.free: OrderedDict[int, None] = OrderedDict()
        self.next_unused = 1  # blocks from here on were never handed out
        self.backed = num_blocks  # blocks below it have memory behind them (set_backed)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free) + self.num_blocks - self.next_unused

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def set_backed(self, blocks: int) -> None:
        """Blocks below `blocks` have their memory backed: never-used ones there go before freed ones, freed
        ones before never-used ones past it."""
        self.backed = max(1, min(blocks, self.num_blocks))

    def lookup(self, block_hash: Hashable) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[int]) -> None:
        """Takes a reference on cached blocks (a prefix hit), pulling free ones out of the free list."""
        for b in blocks:
            if b == NULL_BLOCK:
                continue
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            if self.next_unused < self.backed or not self.free:
                b = self.next_unused
                self.next_unused += 1
            else:
                b, _ = self.free.popitem(last=False)
                self._evict(b)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        # Freed tail-first: a request's last blocks are the least likely to be shared, so go first.
        for b in reversed(blocks):
            if b == NULL_BLOCK:
                continue
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free[b] = None

    def cache(self, block: int, block_hash: Hashable) -> bool:
        """Makes `block` findable under `block_hash`; False when it already was, or an identical one is."""
        if not self.enable_caching or self.block_hash[block] is not None:
            return False
        if block_hash in self.cached:
            return False  # an identical block is already cached; this copy stays private
        self.block_hash[block] = block_hash
        self.cached[block_hash] = block
        return True

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None:
            self.block_hash[b] = None
            if self.cached.get(h) == b:
                del self.cached[h]

    def reset_prefix_cache(self) -> bool:
        if any(self.ref_cnt[1:]):
            return False
        for b in range(1, self.num_blocks):
            self._evict(b)
        return True
