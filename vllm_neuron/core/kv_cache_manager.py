"""Per-request block tables on top of the block pool, with prefix-cache lookup.

Counters `prefix_queries` / `prefix_hits` count prompt tokens looked up and found (vLLM's
`vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`).
"""
from __future__ import annotations

from vllm_neuron.core.block_hash import extend_block_hashes, prompt_block_hashes
from vllm_neuron.core.block_pool import BlockPool
from vllm_neuron.core.request import Request


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.req_blocks: dict[str, list[int]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_table(self, req_id: str) -> list[int]:
        return self.req_blocks.get(req_id, [])

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens. At least one token is
        always left to compute, since the last one's logits are needed."""
        if not self.enable_caching:
            return []
        tokens = request.all_token_ids
        hashes = prompt_block_hashes(tokens[: len(tokens) - 1], self.block_size, request.cache_salt)
        blocks = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def record_prefix_lookup(self, request: Request, cached_blocks: list[int]) -> None:
        """Counts one admitted request's lookup (not every retry while it waited for blocks)."""
        if self.enable_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(cached_blocks) * self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        held = len(self.req_blocks.get(request.request_id, ())) + len(cached_blocks)
        need = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size) - held
        # Cached blocks sitting in the free list are taken out of it by the hit itself.
        reclaimed = sum(1 for b in cached_blocks if self.pool.ref_cnt[b] == 0)
        return need <= self.pool.num_free_blocks - reclaimed

    def allocate(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Grows the request's table to hold num_computed + num_new tokens; False if blocks ran out
        (nothing changes then)."""
        if not self.can_allocate(request, num_new_tokens, cached_blocks):
            return False
        table = self.req_blocks.setdefault(request.request_id, [])
        if cached_blocks:
            self.pool.touch(list(cached_blocks))
            table.extend(cached_blocks)
        need = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Registers the full blocks whose K/V are now computed, so later requests can reuse them."""
        if not self.enable_caching:
            return
        table = self.req_blocks.get(request.request_id)
        if not table:
            return
        start = len(request.block_hashes)
        # Only tokens known on the host can be hashed (async scheduling computes one ahead).
        computed = min(request.num_computed_tokens, request.num_tokens)
        if computed // self.block_size <= start:
            return  # no newly filled block: skip copying the token list on every decode step
        extend_block_hashes(request.block_hashes, request.all_token_ids, computed,
                            self.block_size, request.cache_salt)
        for i in range(start, len(request.block_hashes)):
            self.pool.cache(table[i], request.block_hashes[i])

    def trim(self, request: Request, num_tokens: int) -> None:
        """Returns the blocks past the first `num_tokens` tokens to the pool (rejected speculative
        positions). They hold no verified token, so none of them is hashed or shared."""
        table = self.req_blocks.get(request.request_id)
        keep = blocks_needed(num_tokens, self.block_size)
        if table and len(table) > keep:
            self.pool.release(table[keep:])
            del table[keep:]

    def free(self, request: Request) -> None:
        table = self.req_blocks.pop(request.request_id, None)
        if table:
            self.pool.release(table)
        request.block_hashes = []

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
