"""Scheduler driven by a fake model runner (no model, no tensors).

The fake runner keeps its own copy of every request's tokens (from NewRequestData plus what it
samples) and a fake KV cache: slot -> the token prefix whose K/V it would hold. Every chunk is checked
against that state: its tokens are the request's next tokens, the context before `start_pos` is in the
cache under the chunk's block table, it writes only blocks no other request holds, and decode steps
carry exactly the newest token. A bad block table, a lost prefix or a stale cache hit thus fails the
reading chunk, not some later assertion.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest

from vllm_neuron.core.request import Request, RequestStatus
from vllm_neuron.core.scheduler import Scheduler, SchedulerConfig
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.step import ModelRunnerOutput, SchedulerOutput

EOS = 2


def make(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=4, num_blocks=64,
         caching=True, max_ctx=None, policy="fcfs") -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, block_size, num_blocks,
                                     caching, max_ctx, policy=policy))


def req(rid, prompt, max_tokens=4, eos=None, priority=0, arrival=None, **kw) -> Request:
    extra = {} if arrival is None else {"arrival_time": arrival}
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **kw), eos_token_id=eos,
                   priority=priority, **extra)


def prompt_of(seed: int, n: int) -> list[int]:
    return [10 + (seed * 7919 + i * 31) % 5000 for i in range(n)]


class FakeRunner:
    def __init__(self, sched: Scheduler, token_fn=None) -> None:
        self.s = sched
        self.bs = sched.config.block_size
        self.kv: dict[int, tuple] = {}
        self.tokens: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.new_count: Counter = Counter()
        self.finished_count: Counter = Counter()
        self.recomputed: set[str] = set()  # requests whose prefill chunk covered a sampled token
        self.step = 0
        self.token_fn = token_fn or (lambda rid, step: 100 + step)

    def slot(self, blocks: list[int], pos: int) -> int:
        return blocks[pos // self.bs] * self.bs + pos % self.bs

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:
            assert rid in self.tokens, f"{rid} reported finished but was never sent"
            del self.tokens[rid]
            self.finished_count[rid] += 1
        for nr in out.new_requests:
            assert nr.req_id not in self.tokens, f"{nr.req_id} sent twice"
            self.tokens[nr.req_id] = list(nr.prompt_token_ids)
            self.prompt_len[nr.req_id] = len(nr.prompt_token_ids)
            self.new_count[nr.req_id] += 1
        assert out.chunks
        assert len({c.req_id for c in out.chunks}) == len(out.chunks)
        assert len(out.chunks) <= self.s.config.max_num_seqs
        written: set[int] = set()
        sampled = {}
        for ch in out.chunks:
            toks = self.tokens[ch.req_id]
            end = ch.start_pos + len(ch.token_ids)
            assert ch.token_ids and ch.token_ids == toks[ch.start_pos:end]
            assert 0 not in ch.block_ids
            assert len(ch.block_ids) * self.bs >= end
            for p in range(ch.start_pos):
                assert self.kv.get(self.slot(ch.block_ids, p)) == tuple(toks[:p + 1]), \
                    f"{ch.req_id}: K/V of position {p} missing or overwritten"
            for b in {ch.block_ids[p // self.bs] for p in range(ch.start_pos, end)}:
                assert self.s.kv.pool.ref_cnt[b] == 1, f"{ch.req_id} writes shared block {b}"
            for p in range(ch.start_pos, end):
                sl = self.slot(ch.block_ids, p)
                assert sl not in written
                written.add(sl)
                self.kv[sl] = tuple(toks[:p + 1])
            if out.kind == "decode":
                assert len(ch.token_ids) == 1 and ch.sample and end == len(toks)
            elif end > self.prompt_len[ch.req_id] and len(ch.token_ids) > 1:
                self.recomputed.add(ch.req_id)
            assert ch.sample == (end == len(toks))
            if ch.sample:
                tok = self.token_fn(ch.req_id, self.step)
                toks.append(tok)
                sampled[ch.req_id] = [tok]
        self.step += 1
        return ModelRunnerOutput(sampled)


class Driver:
    """schedule -> fake execute -> update, recording what each step looked like."""

    def __init__(self, sched: Scheduler, token_fn=None) -> None:
        self.s = sched
        self.runner = FakeRunner(sched, token_fn)
        self.steps: list[SchedulerOutput] = []
        self.decodable_before: list[set[str]] = []
        self.finished: dict[str, tuple[Request, str]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.prefill_while_decodes_wait = 0  # prefill tokens since the last decode step, decodes waiting

    def step(self) -> SchedulerOutput | None:
        s = self.s
        decodable = {r.request_id for r in s.running if not r.is_prefilling}
        running_before = list(s.running)
        preemptions = s.num_preemptions
        out = s.schedule()
        if out is None:
            return None
        # Never mixed: a decode step holds only requests that were decodable, a prefill step none.
        ids = {c.req_id for c in out.chunks}
        # The policy's bound: while decodes wait, prefill steps take at most one budget of tokens in all,
        # and only the first of them may split a prompt (unless the decodes were all preempted away).
        if out.kind == "decode" or s.num_preemptions != preemptions:
            self.prefill_while_decodes_wait = 0
        elif decodable:
            first = self.prefill_while_decodes_wait == 0
            self.prefill_while_decodes_wait += out.num_tokens
            assert self.prefill_while_decodes_wait <= s.config.max_num_batched_tokens, \
                "decodes waited for more than one budget of prefill tokens"
            assert first or all(c.sample for c in out.chunks), "a prompt split while decodes waited"
        else:
            self.prefill_while_decodes_wait = 0
        if out.kind == "decode":
            assert ids <= decodable
            # Preemption takes the newest first (fcfs), else the largest (priority, arrival): survivors are a
            # prefix of that order.
            order = running_before if s.config.policy == "fcfs" else \
                sorted(running_before, key=lambda r: (r.priority, r.arrival_time))
            assert set(s.running) == set(order[:len(s.running)])
            assert s.running == [r for r in running_before if r in s.running]  # admission order kept
        else:
            assert not ids & decodable
            assert all(c.start_pos + len(c.token_ids) <= s.config.max_model_len for c in out.chunks)
            assert out.num_tokens <= s.config.max_num_batched_tokens
        assert len(s.running) <= s.config.max_num_seqs
        res = self.runner.execute(out)
        for f in s.update(out, res):
            assert f.request.request_id not in self.finished
            self.finished[f.request.request_id] = (f.request, f.finish_reason)
        for rid, toks in res.sampled.items():
            self.outputs.setdefault(rid, []).extend(toks)
        self.steps.append(out)
        self.decodable_before.append(decodable)
        return out

    def run(self, max_steps=2000) -> None:
        for _ in range(max_steps):
            if not self.s.has_unfinished():
                return
            assert self.step() is not None, "stalled: unfinished requests but nothing scheduled"
        raise AssertionError("did not finish")

    def flush(self) -> None:
        """Delivers pending finished_req_ids to the runner with one throwaway request."""
        self.s.add_request(req("__flush__", [1], max_tokens=1))
        self.run()


def assert_all_blocks_free(s: Scheduler) -> None:
    assert s.kv.pool.num_free_blocks == s.config.num_blocks - 1
    assert not any(s.kv.pool.ref_cnt)
    assert not s.kv.req_blocks


# -- batches ---------------------------------------------------------------------------------------

def test_single_request_prefill_then_decodes():
    s = make()
    d = Driver(s)
    s.add_request(req("a", range(10, 20), max_tokens=3))
    d.run()
    assert [o.kind for o in d.steps] == ["prefill", "decode", "decode"]
    assert [c.start_pos for o in d.steps for c in o.chunks] == [0, 10, 11]
    r, reason = d.finished["a"]
    assert reason == "length" and r.status == RequestStatus.FINISHED_LENGTH
    assert r.output_token_ids == [100, 101, 102] == d.outputs["a"]
    assert_all_blocks_free(s)


def test_segmented_prefill_start_pos_and_sample_only_on_last_chunk():
    s = make(max_num_batched_tokens=16)
    d = Driver(s)
    s.add_request(req("long", prompt_of(1, 50), max_tokens=2))
    s.add_request(req("short", prompt_of(2, 10), max_tokens=2))
    for _ in range(4):
        d.step()
    shape = [[(c.req_id, c.start_pos, len(c.token_ids), c.sample) for c in o.chunks] for o in d.steps]
    assert shape == [
        [("long", 0, 16, False)],
        [("long", 16, 16, False)],
        [("long", 32, 16, False)],
        # The tail of the long prompt and the next prompt share the budget.
        [("long", 48, 2, True), ("short", 0, 10, True)],
    ]
    assert all(o.kind == "prefill" for o in d.steps)
    assert d.step().kind == "decode"
    d.run()
    assert d.outputs == {"long": [103, 104], "short": [103, 104]}
    assert_all_blocks_free(s)


def test_max_num_seqs_respected_and_fcfs_admission():
    s = make(max_num_seqs=3, max_num_batched_tokens=64)
    d = Driver(s)
    for i in range(10):
        s.add_request(req(f"r{i}", prompt_of(i, 5 + i), max_tokens=3 + i % 4))
    d.run()
    first_seen: list[str] = []
    for o in d.steps:
        assert len(o.chunks) <= 3
        first_seen += [n.req_id for n in o.new_requests]
    assert first_seen == [f"r{i}" for i in range(10)]
    assert max(len(o.chunks) for o in d.steps if o.kind == "decode") == 3
    assert {rid: len(t) for rid, t in d.outputs.items()} == {f"r{i}": 3 + i % 4 for i in range(10)}
    assert_all_blocks_free(s)


def test_fcfs_small_request_does_not_overtake_blocked_one():
    # 11 usable blocks of 4 tokens. "a" holds 4; "big" needs 8 more, only 7 are free, so it waits;
    # "small" (1 block) would fit but must not go ahead of it.
    s = make(num_blocks=12, max_num_batched_tokens=64)
    d = Driver(s)
    s.add_request(req("a", prompt_of(0, 16), max_tokens=3))
    d.step()
    s.add_request(req("big", prompt_of(1, 32), max_tokens=1))
    s.add_request(req("small", prompt_of(2, 3), max_tokens=1))
    d.run()
    admitted = [n.req_id for o in d.steps for n in o.new_requests]
    assert admitted == ["a", "big", "small"]
    big_step = next(i for i, o in enumerate(d.steps) if any(c.req_id == "big" for c in o.chunks))
    assert big_step > 1  # it really had to wait for "a" to finish
    assert_all_blocks_free(s)


def test_prefix_counters_count_a_waiting_request_once():
    # 10 usable blocks; "a" holds 4, then 5. "big" (9 blocks, the first 2 shared with "a") needs 7 new
    # ones, so its admission attempts fail (steps 2 and 3) and it waits until "a" finishes.
    s = make(num_blocks=11, max_num_batched_tokens=64)
    d = Driver(s)
    s.add_request(req("a", prompt_of(0, 16), max_tokens=3))
    d.step()
    s.add_request(req("big", prompt_of(0, 8) + prompt_of(1, 28), max_tokens=1))
    d.run()
    big_chunk = next(c for o in d.steps for c in o.chunks if c.req_id == "big")
    assert big_chunk.start_pos == 8
    assert [o.kind for o in d.steps] == ["prefill", "decode", "decode", "prefill"]  # failed tries in steps 2, 3
    # vllm:prefix_cache_queries / _hits count each admitted prompt once, not once per attempt.
    assert s.kv.prefix_queries == 16 + 36
    assert s.kv.prefix_hits == 8


def test_prefill_context_budget_defers_later_request():
    # Context slots per prefill batch are capped; a cached prefix counts against the cap.
    s = make(max_num_batched_tokens=64, max_ctx=12)
    d = Driver(s)
    s.add_request(req("a", prompt_of(0, 13), max_tokens=1))
    d.run()
    s.add_request(req("b", prompt_of(0, 13), max_tokens=1))  # hits 12 cached tokens
    s.add_request(req("c", prompt_of(0, 9), max_tokens=1))  # hits 8: 12 + 8 > 12
    s.add_request(req("d", prompt_of(5, 4), max_tokens=1))  # no context, but must not overtake "c"
    d.step()
    assert [(c.req_id, c.start_pos) for c in d.steps[-1].chunks] == [("b", 12)]
    d.step()
    assert [(c.req_id, c.start_pos) for c in d.steps[-1].chunks] == [("c", 8), ("d", 0)]
    assert_all_blocks_free(s)


# -- prefix caching ----------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, start", [(1, 12), (0, 8), (3, 12)])
def test_cached_prompt_computes_only_the_tail(extra, start):
    s = make()
    d = Driver(s)
    prompt = prompt_of(3, 12 + extra)
    s.add_request(req("a", prompt, max_tokens=2))
    d.run()
    s.add_request(req("b", prompt, max_tokens=2))
    d.step()
    (ch,) = d.steps[-1].chunks
    assert (ch.req_id, ch.start_pos, ch.token_ids) == ("b", start, prompt[start:])
    assert s.requests["b"].num_cached_tokens == start
    d.run()
    assert len(d.outputs["b"]) == 2
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (2 * len(prompt), start)
    assert_all_blocks_free(s)


def test_prefix_caching_disabled_computes_everything():
    s = make(caching=False)
    d = Driver(s)
    prompt = prompt_of(3, 13)
    s.add_request(req("a", prompt, max_tokens=1))
    d.run()
    s.add_request(req("b", prompt, max_tokens=1))
    d.step()
    assert d.steps[-1].chunks[0].start_pos == 0
    d.run()
    assert_all_blocks_free(s)


# -- decode starvation -------------------------------------------------------------------------------

def test_stream_of_prompts_cannot_starve_decodes():
    """Prompts that fill the budget alone, one arriving every step: prefill and decode alternate (the
    Driver checks the bound: one budget of prefill tokens between two decode steps)."""
    s = make(max_num_seqs=64, max_num_batched_tokens=16, num_blocks=400, max_model_len=128)
    d = Driver(s)
    s.add_request(req("first", prompt_of(0, 8), max_tokens=20))
    for i in range(40):
        s.add_request(req(f"p{i}", prompt_of(i + 1, 12), max_tokens=20))
        d.step()
    kinds = [o.kind for o in d.steps]
    # "first" decodes at least every other step from the moment it is ready.
    ready = next(i for i, dec in enumerate(d.decodable_before) if "first" in dec)
    served = [i for i, o in enumerate(d.steps) if any(c.req_id == "first" for c in o.chunks)]
    assert all(b - a <= 2 for a, b in zip(served, served[1:]))
    assert served[0] <= ready + 1
    assert "first" in d.finished
    # Prefills still get every other step too: both kinds keep running.
    assert kinds.count("prefill") >= 15 and kinds.count("decode") >= 15
    d.run()
    assert_all_blocks_free(s)


def test_short_prompts_run_back_to_back_while_decodes_wait_one_budget():
    """TTFT: prompts of 3 tokens arriving one per step while others decode are prefilled in the step
    after they arrive, several prefill steps in a row, and a decode step comes once they have taken
    the budget (16 tokens): decodes never wait more than 6 steps, prefills never more than one decode."""
    s = make(max_num_seqs=64, max_num_batched_tokens=16, num_blocks=400, max_model_len=128)
    d = Driver(s)
    s.add_request(req("first", prompt_of(0, 8), max_tokens=30))
    d.step()
    arrived = {}
    for i in range(30):
        s.add_request(req(f"p{i}", prompt_of(i + 1, 3), max_tokens=30))
        arrived[f"p{i}"] = len(d.steps)
        d.step()
    d.run()
    kinds = "".join(o.kind[0] for o in d.steps)
    assert "ppp" in kinds  # prefills back to back while decodes wait
    first_step = {}
    for i, o in enumerate(d.steps):
        for c in o.chunks:
            first_step.setdefault(c.req_id, i)
    waits = [first_step[r] - arrived[r] for r in arrived]
    assert max(waits) <= 1 and waits.count(0) > len(waits) // 2, waits
    served = [i for i, o in enumerate(d.steps) if o.kind == "decode" and any(c.req_id == "first" for c in o.chunks)]
    assert max(b - a for a, b in zip(served, served[1:])) <= 6
    # FCFS within each kind: first prefills in arrival order; each decode step takes every decodable
    # request, in admission order.
    assert sorted(first_step, key=first_step.get) == ["first", *arrived]
    for o, dec in zip(d.steps, d.decodable_before):
        if o.kind == "decode":
            ids = [c.req_id for c in o.chunks]
            assert set(ids) == dec and ids == sorted(ids, key=list(first_step).index)
    assert_all_blocks_free(s)


def test_long_prompt_is_split_only_by_the_first_prefill_after_a_decode():
    s = make(max_num_seqs=8, max_num_batched_tokens=16, num_blocks=400, max_model_len=128)
    d = Driver(s)
    s.add_request(req("a", prompt_of(0, 4), max_tokens=20))
    d.step()
    for seed, (rid, n, max_tokens) in enumerate([("b", 6, 20), ("long", 40, 2)], 1):
        s.add_request(req(rid, prompt_of(seed, n), max_tokens=max_tokens))
    d.run()
    # b (6 tokens) fits what a's prefill left of the budget; long does not and is not split there: it
    # waits for the decode step, then each piece is the first prefill after a decode.
    assert [c.req_id for c in d.steps[1].chunks] == ["b"]
    pieces = [(i, c.start_pos, len(c.token_ids)) for i, o in enumerate(d.steps) for c in o.chunks
              if c.req_id == "long" and o.kind == "prefill"]
    assert [(start, n) for _, start, n in pieces] == [(0, 16), (16, 16), (32, 8)]
    assert all(d.steps[i - 1].kind == "decode" for i, _, _ in pieces)
    assert_all_blocks_free(s)


def test_back_to_back_prefills_when_nothing_decodes():
    s = make(max_num_batched_tokens=8)
    d = Driver(s)
    s.add_request(req("a", prompt_of(0, 30), max_tokens=1))
    d.run()
    assert [o.kind for o in d.steps] == ["prefill"] * 4


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_policy_orders_waiting_requests_under_a_full_batch(policy):
    # One sequence at a time: everything added while "first" runs waits, then runs in policy order.
    s = make(max_num_seqs=1, max_num_batched_tokens=64, policy=policy)
    d = Driver(s)
    s.add_request(req("first", prompt_of(0, 6), max_tokens=3, priority=5, arrival=0.0))
    d.step()
    for i, (rid, prio) in enumerate([("b", 3), ("c", 1), ("d", 1), ("e", -2), ("f", 3)]):
        s.add_request(req(rid, prompt_of(i + 1, 6), max_tokens=2, priority=prio, arrival=1.0 + i))
    d.run()
    admitted = [n.req_id for o in d.steps for n in o.new_requests]
    if policy == "priority":  # lower first, ties by arrival; the running one is never displaced
        assert admitted == ["first", "e", "c", "d", "b", "f"]
    else:
        assert admitted == ["first", "b", "c", "d", "e", "f"]
    assert {rid: len(t) for rid, t in d.outputs.items()} == {"first": 3, **{r: 2 for r in "bcdef"}}
    assert_all_blocks_free(s)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_policy_preempts_the_lowest_priority_and_requeues_it_in_its_place(policy):
    # 8 usable blocks, two 12-token prompts growing until they collide; "low" came first.
    s = make(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=32, num_blocks=9, policy=policy)
    d = Driver(s)
    s.add_request(req("low", prompt_of(0, 12), max_tokens=20, priority=5, arrival=0.0))
    s.add_request(req("high", prompt_of(1, 12), max_tokens=20, priority=0, arrival=1.0))
    d.step()
    assert {r.request_id for r in s.running} == {"low", "high"}
    s.add_request(req("urgent", prompt_of(2, 4), max_tokens=2, priority=1, arrival=2.0))
    s.add_request(req("later", prompt_of(3, 4), max_tokens=2, priority=9, arrival=3.0))
    while not s.num_preemptions:
        d.step()
    victim = "low" if policy == "priority" else "high"  # fcfs: the newest
    assert s.requests[victim].status == RequestStatus.PREEMPTED
    assert d.steps[-1].preempted_req_ids.keys() == {victim}
    waiting = [r.request_id for r in s.waiting]
    assert waiting == (["urgent", "low", "later"] if policy == "priority" else ["high", "urgent", "later"])
    d.run()
    assert {rid: len(t) for rid, t in d.outputs.items()} == {"low": 20, "high": 20, "urgent": 2, "later": 2}
    assert_all_blocks_free(s)


# -- preemption ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("caching", [True, False])
def test_preemption_many_long_requests_all_finish(caching):
    # 16 usable blocks of 4 tokens = 64 tokens: one max_model_len request fits, eight cannot.
    s = make(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, num_blocks=17, caching=caching)
    d = Driver(s)
    want = {}
    for i in range(8):
        want[f"r{i}"] = 20 + 2 * i  # prompt + max_tokens <= 64
        s.add_request(req(f"r{i}", prompt_of(i, 10 + 2 * i), max_tokens=want[f"r{i}"]))
    d.run()
    assert s.num_preemptions > 0
    assert {rid: len(t) for rid, t in d.outputs.items()} == want
    for rid, (r, reason) in d.finished.items():
        assert reason == "length" and r.output_token_ids == d.outputs[rid]
    preempted = {rid for rid, (r, _) in d.finished.items() if r.num_preemptions}
    assert preempted and sum(r.num_preemptions for r, _ in d.finished.values()) == s.num_preemptions
    # A request preempted after it had sampled is recomputed over prompt + outputs (the fake runner
    # checks the tokens of every chunk against its own prompt + outputs record).
    assert d.runner.recomputed and d.runner.recomputed <= preempted
    # Preemption never re-sends the request, and every request is reported finished exactly once.
    assert set(d.runner.new_count.values()) == {1}
    d.flush()
    assert d.runner.finished_count == Counter({rid: 1 for rid in want})
    assert_all_blocks_free(s)


def test_preemption_victim_is_newest_and_keeps_its_outputs():
    # 8 usable blocks. Two requests of 12-token prompts grow until they collide.
    s = make(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=32, num_blocks=9)
    d = Driver(s)
    s.add_request(req("old", prompt_of(0, 12), max_tokens=20))
    s.add_request(req("new", prompt_of(1, 12), max_tokens=20))
    while not s.num_preemptions:
        d.step()
    victim = s.requests["new"]
    assert victim.status == RequestStatus.PREEMPTED and s.requests["old"].status == RequestStatus.RUNNING
    assert victim.num_computed_tokens == 0 and victim.request_id not in s.kv.req_blocks
    outputs_at_preemption = list(victim.output_token_ids)
    assert outputs_at_preemption
    # The step that preempts it tells the runner, with the output count to keep.
    assert d.steps[-1].preempted_req_ids == {"new": len(outputs_at_preemption)}
    d.run()
    rec = [c for o in d.steps if o.kind == "prefill" for c in o.chunks if c.req_id == "new"][1:]
    assert rec, "the preempted request was never recomputed"
    recomputed = [t for c in rec for t in c.token_ids]
    full = prompt_of(1, 12) + outputs_at_preemption
    assert rec[0].start_pos + len(recomputed) == len(full)
    assert recomputed == full[rec[0].start_pos:]
    assert d.finished["new"][0].output_token_ids[:len(outputs_at_preemption)] == outputs_at_preemption
    assert len(d.outputs["new"]) == len(d.outputs["old"]) == 20
    assert_all_blocks_free(s)


def test_random_workload_invariants():
    rng = random.Random(0)
    s = make(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=48, num_blocks=20)
    d = Driver(s, token_fn=lambda rid, step: 1000 + (hash(rid) + step) % 7)
    want = {}
    n = 0
    for _ in range(300):
        if n < 40 and rng.random() < 0.4:
            shared = prompt_of(99, 8) if rng.random() < 0.5 else []
            p = shared + prompt_of(n, rng.randint(1, 30))
            p = p[:40]
            mt = rng.randint(1, 48 - len(p))
            s.add_request(req(f"q{n}", p, max_tokens=mt))
            want[f"q{n}"] = mt
            n += 1
        if s.has_unfinished():
            assert d.step() is not None
    d.run()
    assert {rid: len(t) for rid, t in d.outputs.items()} == want
    assert_all_blocks_free(s)


@pytest.mark.parametrize("seed", range(8))
def test_random_configs_with_aborts(seed):
    """Tight pools, tiny budgets, odd block sizes and random aborts: nothing stalls, every surviving
    request gets exactly max_tokens tokens and every block comes back."""
    rng = random.Random(seed)
    bs = [1, 2, 4, 8][seed % 4]
    mml = rng.choice([16, 32, 48])
    s = make(max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.choice([4, 8, 16, 64]), max_model_len=mml,
             block_size=bs, num_blocks=-(-mml // bs) + 1 + rng.randint(0, 8), caching=seed % 3 != 0)
    d = Driver(s, token_fn=lambda rid, step: 1000 + (step * 13 + len(rid)) % 5)
    want, aborted = {}, set()
    for n in range(30):
        p = prompt_of(rng.randint(0, 3), mml)[:rng.randint(1, mml - 1)]
        want[f"q{n}"] = rng.randint(1, mml - len(p))
        s.add_request(req(f"q{n}", p, max_tokens=want[f"q{n}"]))
        for _ in range(rng.randint(0, 4)):
            if s.has_unfinished():
                assert d.step() is not None
        if rng.random() < 0.15 and s.requests:
            rid = rng.choice(sorted(s.requests))
            s.finish_request(rid)
            aborted.add(rid)
    d.run(5000)
    assert {rid: len(t) for rid, t in d.outputs.items() if rid not in aborted} == \
        {rid: n for rid, n in want.items() if rid not in aborted}
    assert_all_blocks_free(s)
    d.flush()
    assert set(d.runner.finished_count.values()) == {1}
    assert set(d.runner.finished_count) | {"__flush__"} == set(d.runner.new_count)


# -- abort -----------------------------------------------------------------------------------------------

def test_abort_waiting_and_running_requests():
    s = make(max_num_seqs=1)
    d = Driver(s)
    s.add_request(req("run", prompt_of(0, 9), max_tokens=10))
    s.add_request(req("wait", prompt_of(1, 9), max_tokens=10))
    d.step()
    d.step()
    assert s.requests["run"].status == RequestStatus.RUNNING
    assert s.requests["wait"].status == RequestStatus.WAITING
    w = s.finish_request("wait")
    r = s.finish_request("run")
    assert w.status == r.status == RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort"
    assert s.finish_request("run") is None and s.finish_request("nope") is None
    assert not s.has_unfinished()
    assert_all_blocks_free(s)
    # Only the request the runner knows about is reported, once.
    d.flush()
    assert d.runner.finished_count == Counter({"run": 1})
    assert "wait" not in d.runner.new_count


def test_abort_between_schedule_and_update_is_ignored():
    s = make()
    d = Driver(s)
    s.add_request(req("a", prompt_of(0, 9), max_tokens=5))
    s.add_request(req("b", prompt_of(1, 9), max_tokens=5))
    d.step()
    a, b = s.requests["a"], s.requests["b"]
    out = s.schedule()
    assert out.kind == "decode"
    res = d.runner.execute(out)
    s.finish_request("a")
    assert s.update(out, res) == []
    assert a.output_token_ids == [100] and a.status == RequestStatus.FINISHED_ABORTED
    assert len(b.output_token_ids) == 2
    d.run()
    assert len(b.output_token_ids) == 5 and "a" not in d.finished
    assert_all_blocks_free(s)


def test_abort_preempted_request():
    s = make(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=32, num_blocks=9)
    d = Driver(s)
    s.add_request(req("old", prompt_of(0, 12), max_tokens=20))
    s.add_request(req("new", prompt_of(1, 12), max_tokens=20))
    while not s.num_preemptions:
        d.step()
    assert s.finish_request("new").status == RequestStatus.FINISHED_ABORTED
    d.run()
    d.flush()
    assert d.runner.finished_count["new"] == 1
    assert_all_blocks_free(s)


def test_duplicate_request_id_rejected():
    s = make()
    s.add_request(req("a", [1, 2, 3]))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", [4, 5]))


def test_request_id_reusable_after_finish():
    s = make()
    d = Driver(s)
    s.add_request(req("a", [5, 6, 7], max_tokens=1))
    d.run()
    del d.finished["a"]
    s.add_request(req("a", [8, 9], max_tokens=2))
    d.run()
    # The runner dropped the old state before taking the new one (FakeRunner checks the order).
    assert d.runner.new_count["a"] == 2 and d.runner.finished_count["a"] == 1
    assert d.finished["a"][0].prompt_token_ids == [8, 9]
    assert d.runner.tokens["a"] == [8, 9] + d.finished["a"][0].output_token_ids


# -- stop conditions ---------------------------------------------------------------------------------------

def test_eos_stops():
    s = make()
    d = Driver(s, token_fn=lambda rid, step: EOS if step == 2 else 50)
    s.add_request(req("a", [5, 6, 7], max_tokens=10, eos=EOS))
    d.run()
    r, reason = d.finished["a"]
    assert (reason, r.stop_reason, r.output_token_ids) == ("stop", None, [50, 50, EOS])
    assert r.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens():
    s = make()
    d = Driver(s, token_fn=lambda rid, step: EOS)
    s.add_request(req("a", [5, 6, 7], max_tokens=4, eos=EOS, ignore_eos=True))
    d.run()
    assert d.finished["a"][1] == "length" and d.outputs["a"] == [EOS] * 4


def test_stop_token_ids_report_the_token():
    s = make()
    d = Driver(s, token_fn=lambda rid, step: 100 + step)
    s.add_request(req("a", [5, 6, 7], max_tokens=10, stop_token_ids=[103]))
    d.run()
    r, reason = d.finished["a"]
    assert (reason, r.stop_reason, r.output_token_ids) == ("stop", 103, [100, 101, 102, 103])


def test_max_tokens_and_max_model_len():
    s = make(max_model_len=20)
    d = Driver(s)
    s.add_request(req("cap", prompt_of(0, 5), max_tokens=3))
    s.add_request(req("ctx", prompt_of(1, 16), max_tokens=None))
    d.run()
    assert d.finished["cap"][1] == "length" and len(d.outputs["cap"]) == 3
    # Stops when prompt + outputs reach max_model_len: 16 + 4 = 20.
    assert d.finished["ctx"][1] == "length" and len(d.outputs["ctx"]) == 4
    assert_all_blocks_free(s)


def test_stop_in_a_batch_leaves_others_running():
    s = make()
    d = Driver(s, token_fn=lambda rid, step: EOS if (rid == "x" and step == 1) else 60)
    s.add_request(req("x", [5, 6], max_tokens=10, eos=EOS))
    s.add_request(req("y", [7, 8], max_tokens=4, eos=EOS))
    d.run()
    assert d.outputs == {"x": [60, EOS], "y": [60] * 4}
    # "x" is reported to the runner in the step right after it finished, and only then.
    fin_steps = [i for i, o in enumerate(d.steps) if "x" in o.finished_req_ids]
    assert fin_steps == [2]
    assert_all_blocks_free(s)


def test_new_request_data_sent_exactly_once():
    s = make(max_num_batched_tokens=8)
    d = Driver(s)
    s.add_request(req("a", prompt_of(0, 20), max_tokens=3))
    d.run()
    sent = [n for o in d.steps for n in o.new_requests]
    assert len(sent) == 1 and sent[0].req_id == "a" and sent[0].prompt_token_ids == prompt_of(0, 20)
    assert d.steps[0].new_requests == sent  # with the first chunk
