"""KVCacheManager: block tables, prefix-cache lookup and counters, allocation accounting, freeing."""
from vllm_neuron.core.kv_cache_manager import KVCacheManager, PrefixHit, blocks_needed
from vllm_neuron.core.request import Request
from vllm_neuron.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: tuple = ()) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8), eos_token_id=None, cache_salt=salt)


def prefill(kv: KVCacheManager, r: Request, cached: PrefixHit | None = None) -> None:
    """Admits and fully computes `r`'s tokens, as the scheduler + runner would."""
    r.num_computed_tokens = cached.num_blocks * BS if cached else 0
    assert kv.allocate(r, r.num_tokens - r.num_computed_tokens, cached)
    r.num_computed_tokens = r.num_tokens
    kv.cache_computed_blocks(r)


def test_blocks_needed():
    assert [blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grows_table_and_free_returns_every_block():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r = req("a", range(10))
    assert kv.allocate(r, 10)
    assert len(kv.block_table("a")) == 3
    r.num_computed_tokens = 10
    # One more token fits in the third block; the 13th needs a fourth.
    assert kv.allocate(r, 2)
    assert len(kv.block_table("a")) == 3
    assert kv.allocate(r, 3)
    assert len(kv.block_table("a")) == 4
    assert len(set(kv.block_table("a"))) == 4 and 0 not in kv.block_table("a")
    assert kv.num_free_blocks() == 9 - 4
    kv.free(r)
    assert kv.num_free_blocks() == 9
    assert kv.block_table("a") == []
    kv.free(r)  # a second free is harmless
    assert kv.num_free_blocks() == 9


def test_failed_allocate_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    r = req("a", range(16))
    assert not kv.allocate(r, 16)
    assert kv.block_table("a") == []
    assert kv.num_free_blocks() == 3
    assert kv.allocate(r, 12)
    assert kv.num_free_blocks() == 0


def test_prefix_hit_for_identical_prompt_leaves_last_token():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    a = req("a", prompt)
    prefill(kv, a)
    b = req("b", prompt)
    hit = kv.find_cached_prefix(b)
    # The last token must be computed for its logits, so its (full) block is recomputed.
    assert hit.blocks[0] == kv.block_table("a")[:2]
    c = req("c", prompt + [1])  # one token past the cached blocks: all 3 blocks hit
    assert kv.find_cached_prefix(c).blocks[0] == kv.block_table("a")


def test_prefix_counters_count_prompt_tokens_looked_up_and_found():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(10))  # 2 full blocks + 2
    prefill(kv, req("a", prompt))
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)
    b = req("b", prompt)
    hit = kv.find_cached_prefix(b)
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)  # a lookup alone is not counted: b may wait
    kv.record_prefix_lookup(b, hit)
    assert (kv.prefix_queries, kv.prefix_hits) == (10, 8)
    c = req("c", [50] + prompt[1:])  # first block differs: no hit at all
    kv.record_prefix_lookup(c, kv.find_cached_prefix(c))
    assert (kv.prefix_queries, kv.prefix_hits) == (20, 8)


def test_hit_stops_at_first_miss_because_of_chaining():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prefill(kv, req("a", list(range(13))))
    # Block 1 differs; block 2 is identical to a's but its prefix is not, so it cannot hit.
    toks = list(range(13))
    toks[5] = 99
    assert kv.find_cached_prefix(req("b", toks)).blocks[0] == kv.block_table("a")[:1]


def test_cache_salt_separates_prefixes():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prefill(kv, req("a", range(9), salt=("x",)))
    assert kv.find_cached_prefix(req("b", range(9))).num_blocks == 0
    assert kv.find_cached_prefix(req("c", range(9), salt=("y",))).num_blocks == 0
    assert kv.find_cached_prefix(req("d", range(9), salt=("x",))).num_blocks == 2


def test_prefix_survives_free_and_is_shared_with_ref_counts():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    a = req("a", range(9))
    prefill(kv, a)
    table_a = list(kv.block_table("a"))
    kv.free(a)
    assert kv.num_free_blocks() == 19
    b = req("b", range(9))
    hit = kv.find_cached_prefix(b)
    assert hit.blocks[0] == table_a[:2]
    prefill(kv, b, hit)
    assert kv.block_table("b")[:2] == table_a[:2]
    c = req("c", list(range(8)) + [77])
    hit_c = kv.find_cached_prefix(c)
    prefill(kv, c, hit_c)
    assert kv.block_table("c")[:2] == table_a[:2]
    assert kv.pool.ref_cnt[table_a[0]] == 2
    # Shared blocks are counted once: b and c hold 2 shared + 1 own each.
    assert kv.num_free_blocks() == 19 - 4
    kv.free(b)
    kv.free(c)
    assert kv.num_free_blocks() == 19
    assert all(n == 0 for n in kv.pool.ref_cnt)


def test_can_allocate_accounts_for_cached_free_blocks():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    a = req("a", range(9))
    prefill(kv, a)  # 3 blocks, 2 of them hashed
    kv.free(a)
    filler = req("f", range(100, 104))
    assert kv.allocate(filler, 4)  # takes the never-used block: 3 free, all from a
    assert kv.num_free_blocks() == 3
    b = req("b", list(range(8)) + [50, 51, 52, 53, 54])  # 13 tokens: 4 blocks, 2 of them hit
    hit = kv.find_cached_prefix(b)
    assert hit.num_blocks == 2
    b.num_computed_tokens = 8
    # The 2 hit blocks come out of the free list, leaving 1 for the 2 new blocks: must refuse.
    assert not kv.can_allocate(b, 5, hit)
    assert not kv.allocate(b, 5, hit)
    assert kv.num_free_blocks() == 3 and kv.block_table("b") == []
    # One fewer token needs only one new block: fits.
    b2 = req("b2", list(range(8)) + [50, 51, 52])
    hit2 = kv.find_cached_prefix(b2)
    b2.num_computed_tokens = 8
    assert kv.can_allocate(b2, 3, hit2)
    assert kv.allocate(b2, 3, hit2)
    assert kv.block_table("b2")[:2] == hit2.blocks[0]
    assert kv.num_free_blocks() == 0


def test_can_allocate_with_hit_blocks_held_by_another_request():
    kv = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    a = req("a", range(9))
    prefill(kv, a)  # holds 3, 1 free
    b = req("b", list(range(8)) + [5, 6, 7])
    hit = kv.find_cached_prefix(b)
    assert hit.num_blocks == 2
    b.num_computed_tokens = 8
    # Held hit blocks cost nothing: only 1 new block is needed and 1 is free.
    assert kv.allocate(b, 3, hit)
    assert kv.num_free_blocks() == 0
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks() == 4


def test_caching_disabled():
    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=False)
    prefill(kv, req("a", range(9)))
    assert kv.find_cached_prefix(req("b", range(9))).num_blocks == 0
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)


def test_cache_computed_blocks_hashes_only_computed_full_blocks():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    r = req("a", range(10))
    assert kv.allocate(r, 10)
    r.num_computed_tokens = 6  # a segment of 6 computed: one full block
    kv.cache_computed_blocks(r)
    assert len(r.block_hashes) == 1
    assert kv.find_cached_prefix(req("b", range(10))).blocks[0] == kv.block_table("a")[:1]
    r.num_computed_tokens = 10
    kv.cache_computed_blocks(r)
    assert len(r.block_hashes) == 2
    kv.free(r)
    assert r.block_hashes == []


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    a = req("a", range(9))
    prefill(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert kv.find_cached_prefix(req("b", range(9))).num_blocks == 0
