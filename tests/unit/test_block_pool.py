"""BlockPool (free list, ref counts, hash -> cached block) and the chained block hashes."""
import pytest

from vllm_neuron.core.block_hash import extend_block_hashes, hash_block, prompt_block_hashes
from vllm_neuron.core.block_pool import NULL_BLOCK, BlockPool


def h(i: int) -> bytes:
    return hash_block(None, [i])


# -- block pool ----------------------------------------------------------------------------------

def test_rejects_pool_without_usable_block():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1)


def test_allocation_order_and_null_block_never_handed_out():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5
    assert pool.allocate(2) == [1, 2]
    assert pool.allocate(3) == [3, 4, 5]
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    # Recycling the whole pool many times never yields block 0.
    pool.release([1, 2, 3, 4, 5])
    seen = set()
    for _ in range(10):
        got = pool.allocate(5)
        seen.update(got)
        pool.release(got)
    assert NULL_BLOCK not in seen
    assert seen == {1, 2, 3, 4, 5}


def test_backed_line_orders_unused_then_freed_then_unbacked_blocks():
    """Below the line the runner has backed, never-used blocks go first (they evict nothing); then the least
    recently freed block, its cached prefix with it; never-used blocks past the line only when none is free."""
    pool = BlockPool(10)
    pool.set_backed(4)  # blocks 1-3 have memory behind them
    a = pool.allocate(2)
    assert a == [1, 2]
    pool.cache(1, h(1))
    pool.release(a)  # freed tail first: 2, then 1
    assert pool.num_free_blocks == 9
    assert pool.allocate(2) == [3, 2]  # the last backed never-used block, then the oldest freed one
    assert pool.lookup(h(1)) == 1  # still cached
    assert pool.allocate(3) == [1, 4, 5]  # 1 evicted before memory past the line is touched
    assert pool.lookup(h(1)) is None
    pool.set_backed(8)  # the runner backed more: 6 and 7 go before anything freed
    pool.release([4])
    assert pool.allocate(3) == [6, 7, 4]
    assert pool.num_free_blocks == 2 and pool.allocate(2) == [8, 9]
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_failed_allocation_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    assert pool.num_free_blocks == 2
    assert pool.allocate(2) == [2, 3]


def test_ref_counts_shared_block_freed_on_last_release():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.cache(b, h(1))
    pool.touch([b])  # a second request shares it
    assert pool.ref_cnt[b] == 2
    pool.release([b])
    assert pool.ref_cnt[b] == 1
    assert b not in pool.free
    assert pool.num_free_blocks == 2
    pool.release([b])
    assert pool.ref_cnt[b] == 0
    assert pool.num_free_blocks == 3


def test_release_tail_first_sets_eviction_order():
    pool = BlockPool(8)
    first = pool.allocate(3)  # [1, 2, 3]
    second = pool.allocate(3)  # [4, 5, 6]
    rest = pool.allocate(1)  # [7]
    pool.release(first)
    pool.release(second)
    pool.release(rest)
    # The tail of each freed table is reused before its head; earlier releases go first.
    assert pool.allocate(7) == [3, 2, 1, 6, 5, 4, 7]


def test_cached_block_findable_after_release_until_reused():
    pool = BlockPool(4)  # 3 usable blocks
    a, b = pool.allocate(2)
    pool.cache(a, h(1))
    pool.cache(b, h(2))
    pool.release([a, b])  # frees b then a: b is evicted first
    assert pool.lookup(h(1)) == a
    assert pool.lookup(h(2)) == b
    # Block 3 was never used, so it goes first; nothing is evicted yet.
    assert pool.allocate(1) == [3]
    assert pool.lookup(h(1)) == a and pool.lookup(h(2)) == b
    # Next reuse evicts b (the tail, freed first), a stays findable.
    assert pool.allocate(1) == [b]
    assert pool.lookup(h(2)) is None
    assert pool.block_hash[b] is None
    assert pool.lookup(h(1)) == a


def test_touch_reclaims_cached_free_block():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache(a, h(1))
    pool.release([a])
    assert pool.num_free_blocks == 2
    pool.touch([pool.lookup(h(1))])
    assert pool.ref_cnt[a] == 1
    assert pool.num_free_blocks == 1
    # The hit block is no longer in the free list, so the next allocation cannot evict it.
    (other,) = pool.allocate(1)
    assert other != a
    assert pool.lookup(h(1)) == a


def test_duplicate_hash_keeps_one_cached_copy():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, h(1))
    pool.cache(b, h(1))  # same content computed twice (two requests in one batch)
    assert pool.lookup(h(1)) == a
    assert pool.block_hash[b] is None
    # Reusing the private copy must not drop the cached one.
    pool.release([b])
    pool.allocate(2)  # takes 3, then b
    assert pool.lookup(h(1)) == a
    # Evicting the cached copy forgets the hash.
    pool.release([a])
    pool.allocate(1)
    assert pool.lookup(h(1)) is None


def test_cache_does_not_rehash_a_cached_block():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.cache(a, h(1))
    pool.cache(a, h(2))
    assert pool.lookup(h(1)) == a
    assert pool.lookup(h(2)) is None


def test_caching_disabled_never_finds_blocks():
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache(a, h(1))
    pool.release([a])
    assert pool.lookup(h(1)) is None


def test_reset_prefix_cache():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, h(1))
    pool.cache(b, h(2))
    pool.release([b])
    # Refused while a block is held: its hash would otherwise vanish under a running request.
    assert pool.reset_prefix_cache() is False
    assert pool.lookup(h(1)) == a and pool.lookup(h(2)) == b
    pool.release([a])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(h(1)) is None and pool.lookup(h(2)) is None
    assert pool.num_free_blocks == 3


def test_usage_counts_cached_free_blocks_as_free():
    pool = BlockPool(5)
    assert pool.usage == 0.0
    blocks = pool.allocate(2)
    assert pool.usage == pytest.approx(0.5)
    pool.cache(blocks[0], h(1))
    pool.release(blocks)
    assert pool.usage == 0.0


# -- block hashes --------------------------------------------------------------------------------

def test_hash_chains_over_the_whole_prefix():
    tail = [7, 8, 9, 10]
    a = prompt_block_hashes([1, 2, 3, 4] + tail, 4)
    b = prompt_block_hashes([5, 6, 7, 8] + tail, 4)
    assert len(a) == len(b) == 2
    # Same tokens in block 1, different prefixes: different hashes.
    assert a[1] != b[1]
    # Same prefix, same tokens: same hash (deterministic).
    assert prompt_block_hashes([1, 2, 3, 4] + tail, 4) == a
    # Same block content at a different position in an otherwise equal sequence differs too.
    assert prompt_block_hashes(tail + tail, 4)[1] != prompt_block_hashes(tail, 4)[0]


def test_hash_depends_on_token_order_and_value():
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(None, [1, 2]) != hash_block(None, [1, 3])
    assert hash_block(None, [1, 2]) != hash_block(h(0), [1, 2])


def test_extra_keys_change_the_hash():
    toks = [1, 2, 3, 4]
    plain = prompt_block_hashes(toks, 4)
    salted = prompt_block_hashes(toks, 4, ("lora-a",))
    other = prompt_block_hashes(toks, 4, ("lora-b",))
    assert plain != salted != other != plain
    assert prompt_block_hashes(toks, 4, ("lora-a",)) == salted


def test_only_full_blocks_are_hashed():
    assert prompt_block_hashes([1, 2, 3], 4) == []
    assert len(prompt_block_hashes(list(range(7)), 4)) == 1
    assert len(prompt_block_hashes(list(range(8)), 4)) == 2
    # A partial last block does not change the hashes of the full ones.
    assert prompt_block_hashes(list(range(9)), 4) == prompt_block_hashes(list(range(8)), 4)


def test_extend_block_hashes_is_incremental():
    toks = list(range(20))
    hashes: list[bytes] = []
    extend_block_hashes(hashes, toks, 6, 4)
    assert len(hashes) == 1
    extend_block_hashes(hashes, toks, 13, 4)
    assert len(hashes) == 3
    # Same result as hashing all at once; earlier entries are kept, not recomputed.
    assert hashes == prompt_block_hashes(toks[:12], 4)
    first = hashes[0]
    extend_block_hashes(hashes, [99] * 20, 16, 4)  # only block 3 is new
    assert hashes[0] is first and len(hashes) == 4
    assert hashes[3] == hash_block(hashes[2], [99] * 4)
