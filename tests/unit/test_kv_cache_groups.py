"""KV cache groups: layout planning, sliding-window groups giving blocks back, prefix hits across groups,
and the scheduler driven over a window-aware fake KV cache (no tensors)."""
from __future__ import annotations

import pytest

from vllm_neuron.core.block_pool import NULL_BLOCK
from vllm_neuron.core.kv_cache_manager import KVCacheManager
from vllm_neuron.core.request import Request
from vllm_neuron.core.scheduler import Scheduler, SchedulerConfig
from vllm_neuron.kv_cache_groups import first_needed_block, plan_kv_cache_layout
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.step import ModelRunnerOutput

BS, W = 4, 8  # a query sees itself and the 7 positions before it: at most 3 blocks of 4


def gpt_oss_layout(num_layers: int = 4, window: int = W):
    return plan_kv_cache_layout([window if i % 2 == 0 else None for i in range(num_layers)])


def req(rid: str, tokens, max_tokens: int = 8) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=None)


def test_layout_alternating_layers_two_groups_full_first():
    lay = gpt_oss_layout(4)
    assert [(g.layers, g.sliding_window) for g in lay.groups] == [((1, 3), None), ((0, 2), W)]
    assert lay.group_size == 2 and lay.layer_group() == (1, 0, 1, 0) and lay.layer_slot() == (0, 0, 1, 1)


def test_layout_uneven_counts_use_the_gcd_and_one_kind_is_one_group():
    lay = plan_kv_cache_layout([16, 16, 16, 16, None, None] * 1)  # 4 sliding : 2 full -> groups of 2
    assert [(g.layers, g.sliding_window) for g in lay.groups] == [((4, 5), None), ((0, 1), 16), ((2, 3), 16)]
    assert plan_kv_cache_layout([None] * 3).num_groups == 1
    one = plan_kv_cache_layout([W] * 3)
    assert one.num_groups == 1 and one.groups[0].sliding_window == W
    with pytest.raises(ValueError, match="sliding window must be positive"):
        plan_kv_cache_layout([0, None])


def test_blocks_per_request_bounds_the_sliding_group_by_its_window_and_one_chunk():
    # 64 tokens: the full group holds 16 blocks; the sliding one (7 + 8) tokens of history and chunk + 1.
    assert gpt_oss_layout().blocks_per_request(64, BS, 8) == 16 + 5
    assert plan_kv_cache_layout([None] * 2).blocks_per_request(64, BS, 8) == 16


def test_first_needed_block():
    # After 12 computed tokens the next query (position 12) sees 5..12: block 1 onwards.
    assert [first_needed_block(n, W, BS) for n in (0, 7, 8, 11, 12, 16)] == [0, 0, 0, 1, 1, 2]


def test_long_decode_holds_a_bounded_number_of_sliding_blocks():
    kv = KVCacheManager(num_blocks=64, block_size=BS, layout=gpt_oss_layout())
    r = req("a", range(100, 110))
    assert kv.allocate(r, 10)
    r.num_computed_tokens = 10
    kv.cache_computed_blocks(r)
    held = []
    for _ in range(60):  # decode: one token per step
        assert kv.allocate(r, 1)
        held.append(kv.num_held_blocks("a", 1))
        table = kv.block_table("a", 1)
        # Every position this step's query window reaches is in a real block; nothing before it is.
        lo = first_needed_block(r.num_computed_tokens, W, BS)
        assert NULL_BLOCK not in table[lo:] and set(table[:lo]) <= {NULL_BLOCK}
        r.output_token_ids.append(7)
        r.num_computed_tokens += 1
        kv.cache_computed_blocks(r)
    assert max(held) <= -(-W // BS) + 1
    assert len(kv.block_table("a", 0)) == kv.num_held_blocks("a", 0) == -(-70 // BS)  # full group keeps all
    # Given-back blocks are free again: the pool holds exactly the two groups' live blocks.
    assert kv.num_free_blocks() == 63 - kv.num_held_blocks("a", 0) - kv.num_held_blocks("a", 1)
    kv.free(r)
    assert kv.num_free_blocks() == 63


def test_prefix_hit_takes_only_the_window_from_the_sliding_group():
    kv = KVCacheManager(num_blocks=64, block_size=BS, layout=gpt_oss_layout())
    prompt = list(range(100, 140))  # 10 full blocks
    a = req("a", prompt)
    assert kv.allocate(a, 40)
    a.num_computed_tokens = 40
    kv.cache_computed_blocks(a)
    full_a = list(kv.block_table("a", 0))
    hit = kv.find_cached_prefix(req("b", prompt + [1]))
    assert hit.num_blocks == 10 and hit.blocks[0] == full_a
    lo = first_needed_block(40, W, BS)
    assert hit.blocks[1][:lo] == [NULL_BLOCK] * lo and hit.blocks[1][lo:] == kv.block_table("a", 1)[lo:]
    # The same blocks under another group are other blocks: the groups' caches never mix.
    assert not set(hit.blocks[0]) & set(hit.blocks[1][lo:])


def test_prefix_hit_shrinks_to_where_the_sliding_group_still_has_its_window():
    kv = KVCacheManager(num_blocks=64, block_size=BS, layout=gpt_oss_layout())
    prompt = list(range(100, 140))
    a = req("a", prompt)
    assert kv.allocate(a, 40)
    a.num_computed_tokens = 40
    kv.cache_computed_blocks(a)
    full, sliding = list(kv.block_table("a", 0)), list(kv.block_table("a", 1))
    kv.free(a)
    assert kv.find_cached_prefix(req("b", prompt + [1])).num_blocks == 10
    # Evict the sliding group's blocks 9 and 7: a hit of 10 needs 8..9, of 9 needs 7..8, of 8 needs 6..7,
    # of 7 needs 5..6 (cached): the hit shrinks to 7 blocks although the full group has all 10.
    for i in (9, 7):
        kv.pool.touch([sliding[i]])
        kv.pool._evict(sliding[i])
        kv.pool.release([sliding[i]])
    c = req("c", prompt + [1])
    hit = kv.find_cached_prefix(c)
    assert hit.num_blocks == 7 and hit.blocks[0] == full[:7]
    assert hit.blocks[1] == [NULL_BLOCK] * 5 + sliding[5:7]
    c.num_computed_tokens = 28
    assert kv.allocate(c, 13, hit)
    assert kv.block_table("c", 0)[:7] == full[:7] and kv.block_table("c", 1)[5:7] == sliding[5:7]


class WindowedFakeRunner:
    """Checks every chunk against a fake per-group KV cache: slot -> (group, token prefix). A full group's
    queries must find every earlier position, a sliding group's those inside the window."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.kv: dict[tuple[int, int], tuple] = {}
        self.tokens: dict[str, list[int]] = {}
        self.max_held = 0

    def execute(self, out) -> ModelRunnerOutput:
        for nr in out.new_requests:
            self.tokens[nr.req_id] = list(nr.prompt_token_ids)
        sampled = {}
        windows = self.s.kv.windows
        for ch in out.chunks:
            toks = self.tokens[ch.req_id]
            tables = (ch.block_ids, *ch.group_block_ids)
            assert len(tables) == len(windows)
            end = ch.start_pos + len(ch.token_ids)
            for g, (table, w) in enumerate(zip(tables, windows)):
                lo = 0 if w is None else max(0, ch.start_pos - w + 1)
                for p in range(lo, ch.start_pos):
                    b = table[p // BS]
                    assert b != NULL_BLOCK, f"{ch.req_id}: group {g} dropped position {p} still in the window"
                    assert self.kv.get((g, b * BS + p % BS)) == tuple(toks[:p + 1]), f"{ch.req_id} g{g} p{p} lost"
                for p in range(ch.start_pos, end):
                    self.kv[(g, table[p // BS] * BS + p % BS)] = tuple(toks[:p + 1])
                if w is not None:
                    self.max_held = max(self.max_held, self.s.kv.num_held_blocks(ch.req_id, g))
            if ch.sample:
                toks.append(50 + len(toks) % 7)
                sampled[ch.req_id] = [toks[-1]]
        return ModelRunnerOutput(sampled)


def test_scheduler_with_groups_keeps_windows_prefix_hits_and_bounded_blocks():
    # Small pool: preemption and eviction happen; shared prefixes give cross-group hits.
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8, max_model_len=64, block_size=BS, num_blocks=40,
                          kv_cache_layout=gpt_oss_layout())
    s = Scheduler(cfg)
    runner = WindowedFakeRunner(s)
    shared = list(range(200, 224))
    for i in range(6):
        s.add_request(req(f"r{i}", shared + [300 + i] * (3 + 5 * i), max_tokens=12))
    steps = 0
    while s.has_unfinished():
        out = s.schedule()
        assert out is not None
        s.update(out, runner.execute(out))
        steps += 1
        assert steps < 2000
    assert s.kv.prefix_hits > 0
    assert runner.max_held <= -(-(W - 1 + cfg.max_num_batched_tokens) // BS) + 1
    assert s.kv.num_free_blocks() == cfg.num_blocks - 1


def test_same_budget_fits_about_twice_the_long_gpt_oss_sequences():
    # gpt-oss-20b's KV shape: 24 layers alternating window 128 / full, 8 KV heads of 64; blocks of 32 tokens,
    # 8,192-token requests prefilled in chunks of 512, bf16, a 16 GiB budget.
    from vllm_neuron.worker.memory import kv_cache_bytes_per_block

    budget, mml, bs, chunk = 16 << 30, 8192, 32, 512
    concurrency = {}
    for name, layout in (("one group", plan_kv_cache_layout([None] * 24)),
                         ("groups", plan_kv_cache_layout([128 if i % 2 == 0 else None for i in range(24)]))):
        per_block = kv_cache_bytes_per_block(layout.group_size, 8, 64, bs, 2)
        concurrency[name] = (budget // per_block) / layout.blocks_per_request(mml, bs, chunk)
    print(concurrency)
    assert concurrency["groups"] > 1.8 * concurrency["one group"]
