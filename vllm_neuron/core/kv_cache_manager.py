"""Per-request block tables, one per KV cache group, on top of one block pool, with prefix-cache lookup.

A model has one group (every layer) or, with sliding-window layers, several (kv_cache_groups.py). Every
group's table has one entry per block of the request's tokens, so a token's block index is the same in
all of them. A sliding-window group gives its blocks back once all their tokens left the window of the
next query: the table keeps the NULL block at their index (attention never reads there).

Prefix caching: a block is cached under (group, chained hash) - the same tokens give one block per
group, holding different layers. A hit of k blocks needs, in each full-attention group, all k blocks
cached, and in each sliding-window group only those the next query's window reaches; the longest k
that every group can serve is the hit (the other positions of a sliding group's table are NULL).

Counters `prefix_queries` / `prefix_hits` count prompt tokens looked up and found (vLLM's
`vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`).
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_neuron.core.block_hash import extend_block_hashes, prompt_block_hashes
from vllm_neuron.core.block_pool import NULL_BLOCK, BlockPool
from vllm_neuron.core.request import Request
from vllm_neuron.kv_cache_groups import KVCacheLayout, first_needed_block, single_group_layout


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class PrefixHit:
    """A cached prefix: per group, one block per hit block index (NULL where a sliding group needs none)."""

    blocks: tuple[list[int], ...]
    hashes: tuple[bytes, ...] = ()  # the prompt's full-block hashes the lookup computed (a second tier reads on)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks[0]) if self.blocks else 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 layout: KVCacheLayout | None = None) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.enable_caching = enable_caching
        self.layout = layout or single_group_layout(1)
        self.windows = tuple(g.sliding_window for g in self.layout.groups)
        self.req_blocks: dict[str, list[list[int]]] = {}  # request -> per group table
        self._released: dict[str, list[int]] = {}  # request -> per group: table entries [0, n) given back
        self.prefix_queries = 0
        self.prefix_hits = 0
        # (block, hash) of the blocks newly registered in group 0, for a second tier to keep (core/kv_tier.py);
        # None: nobody takes them.
        self.newly_cached: list[tuple[int, bytes]] | None = None

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def usage(self) -> float:
        return self.pool.usage

    def set_backed_blocks(self, blocks: int) -> None:
        """Blocks below `blocks` have memory behind them: the pool stays below that while it can (block_pool.py)."""
        self.pool.set_backed(blocks)

    def block_table(self, req_id: str, group: int = 0) -> list[int]:
        tables = self.req_blocks.get(req_id)
        return tables[group] if tables else []

    def num_held_blocks(self, req_id: str, group: int) -> int:
        """Blocks the request holds in one group (NULL entries excluded)."""
        return sum(1 for b in self.block_table(req_id, group) if b != NULL_BLOCK)

    def _key(self, group: int, block_hash: bytes):
        return block_hash if group == 0 else (group, block_hash)

    def empty_hit(self) -> PrefixHit:
        return PrefixHit(tuple([] for _ in self.windows))

    def prompt_hashes(self, request: Request) -> list[bytes]:
        """The hashes of the full blocks among the request's tokens but the last (whose logits are needed)."""
        tokens = request.all_token_ids
        return prompt_block_hashes(tokens[: len(tokens) - 1], self.block_size, request.cache_salt)

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest cached prefix of the request's tokens every group can serve. At least one token is
        always left to compute, since the last one's logits are needed."""
        if not self.enable_caching:
            return self.empty_hit()
        hashes = self.prompt_hashes(request)
        k = len(hashes)
        found: list[list[int | None]] = []
        for g, w in enumerate(self.windows):
            if w is None:  # a full-attention group needs every block: the hit ends at its first miss
                blocks = []
                for h in hashes[:k]:
                    b = self.pool.lookup(self._key(g, h))
                    if b is None:
                        break
                    blocks.append(b)
                k = len(blocks)
            else:
                blocks = [self.pool.lookup(self._key(g, h)) for h in hashes]
            found.append(blocks)
        # Sliding groups: shorten the hit until each has the blocks its window reaches from there.
        while k and not all(all(b is not None for b in found[g][first_needed_block(k * self.block_size, w,
                                                                                    self.block_size):k])
                            for g, w in enumerate(self.windows) if w is not None):
            k -= 1
        out = []
        for g, w in enumerate(self.windows):
            lo = 0 if w is None else first_needed_block(k * self.block_size, w, self.block_size)
            out.append([NULL_BLOCK] * lo + found[g][lo:k])
        return PrefixHit(tuple(out), tuple(hashes))

    def record_prefix_lookup(self, request: Request, hit: PrefixHit | None) -> None:
        """Counts one admitted request's lookup (not every retry while it waited for blocks)."""
        if self.enable_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += (hit.num_blocks if hit else 0) * self.block_size

    def can_allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        total = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size)
        tables = self.req_blocks.get(request.request_id)
        need = reclaimed = 0
        for g in range(self.num_groups):
            held = (len(tables[g]) if tables else 0) + (len(hit.blocks[g]) if hit else 0)
            need += max(0, total - held)
            if hit:
                # Cached blocks sitting in the free list are taken out of it by the hit itself.
                reclaimed += sum(1 for b in hit.blocks[g] if b != NULL_BLOCK and self.pool.ref_cnt[b] == 0)
        return need <= self.pool.num_free_blocks - reclaimed

    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit | None = None) -> bool:
        """Grows the request's tables to hold num_computed + num_new tokens, after giving back the blocks
        that left the sliding windows; False if blocks ran out (the tables are unchanged then)."""
        self._release_out_of_window(request)
        if not self.can_allocate(request, num_new_tokens, hit):
            return False
        rid = request.request_id
        tables = self.req_blocks.get(rid)
        if tables is None:
            tables = self.req_blocks[rid] = [[] for _ in self.windows]
            self._released[rid] = [0] * self.num_groups
        if hit and hit.num_blocks:
            for g, blocks in enumerate(hit.blocks):
                self.pool.touch(blocks)
                tables[g].extend(blocks)
        total = blocks_needed(request.num_computed_tokens + num_new_tokens, self.block_size)
        for table in tables:
            if total > len(table):
                table.extend(self.pool.allocate(total - len(table)))
        return True

    def _release_out_of_window(self, request: Request) -> None:
        tables = self.req_blocks.get(request.request_id)
        if not tables:
            return
        released = self._released[request.request_id]
        for g, w in enumerate(self.windows):
            if w is None:
                continue
            table = tables[g]
            upto = min(first_needed_block(request.num_computed_tokens, w, self.block_size), len(table))
            if upto > released[g]:
                self.pool.release(table[released[g]:upto])
                table[released[g]:upto] = [NULL_BLOCK] * (upto - released[g])
                released[g] = upto

    def cache_computed_blocks(self, request: Request) -> None:
        """Registers the full blocks whose K/V are now computed, so later requests can reuse them."""
        if not self.enable_caching:
            return
        tables = self.req_blocks.get(request.request_id)
        if not tables:
            return
        start = len(request.block_hashes)
        # Only tokens known on the host can be hashed (async scheduling computes one ahead).
        computed = min(request.num_computed_tokens, request.num_tokens)
        if computed // self.block_size <= start:
            return  # no newly filled block: skip copying the token list on every decode step
        extend_block_hashes(request.block_hashes, request.all_token_ids, computed,
                            self.block_size, request.cache_salt)
        for g, table in enumerate(tables):
            for i in range(start, len(request.block_hashes)):
                if table[i] != NULL_BLOCK:  # already given back (left the window before it was hashed)
                    if self.pool.cache(table[i], self._key(g, request.block_hashes[i])) and g == 0 and \
                            self.newly_cached is not None:
                        self.newly_cached.append((table[i], request.block_hashes[i]))

    def trim(self, request: Request, num_tokens: int) -> None:
        """Returns the blocks past the first `num_tokens` tokens to the pool (rejected speculative
        positions). They hold no verified token, so none of them is hashed or shared."""
        keep = blocks_needed(num_tokens, self.block_size)
        for table in self.req_blocks.get(request.request_id, ()):
            if len(table) > keep:
                self.pool.release(table[keep:])
                del table[keep:]

    def free(self, request: Request) -> None:
        tables = self.req_blocks.pop(request.request_id, None)
        self._released.pop(request.request_id, None)
        for table in tables or ():
            self.pool.release(table)
        request.block_hashes = []

    def detach(self, request: Request) -> list[list[int]]:
        """Takes the request's tables out without freeing their blocks (a prefill instance holds them for a
        remote reader); `release_tables` frees them later. Cached blocks stay findable meanwhile."""
        tables = self.req_blocks.pop(request.request_id, None) or []
        self._released.pop(request.request_id, None)
        request.block_hashes = []
        return tables

    def release_tables(self, tables: list[list[int]]) -> None:
        for table in tables:
            self.pool.release(table)

    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
