"""KV block pool: free list in eviction order, reference counts and the hash -> block map.

Block 0 is the null block: never handed out, it absorbs the writes of padding tokens and stands in a
sliding-window group's table for the blocks that left the window (touch / release skip it). A freed block
that holds a hashed (full) prefix stays findable until it is reused, which is what makes prefix
caching survive a request's end; eviction takes the least recently freed block first.
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
        # Insertion order is eviction order: the front is reused first.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / (self.num_blocks - 1)

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
        if n > len(self.free):
            raise RuntimeError(f"cannot allocate {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
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
