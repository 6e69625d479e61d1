"""Scheduler with speculative decoding, driven by a fake target and a fake draft (no tensors).

The fake target's next token is a function of the whole prefix, so the output with speculation must
equal the output without it. The fake KV cache records, per slot, the prefix whose K/V it holds:
rejected drafts leave wrong K/V behind, and any later step that reads such a position as verified
context fails at once - this is what proves the rollback of num_computed_tokens, the block trimming,
and that prefix-cache hashes cover verified tokens only.
"""
from __future__ import annotations

import random

import pytest

from tests.unit.test_scheduler import Driver, assert_all_blocks_free, make, prompt_of, req
from vllm_neuron.core.scheduler import Scheduler, SchedulerConfig
from vllm_neuron.step import ModelRunnerOutput, SchedulerOutput

K = 3


def target(prefix) -> int:
    return 1000 + (sum(prefix[-3:]) * 7 + len(prefix)) % 13


class FakeSpecRunner:
    def __init__(self, sched: Scheduler, agree: float, seed: int = 0) -> None:
        self.s = sched
        self.bs = sched.config.block_size
        self.kv: dict[int, tuple] = {}
        self.tokens: dict[str, list[int]] = {}
        self.agree = agree
        self.rng = random.Random(seed)
        self.max_drafts_seen = 0

    def slot(self, blocks, pos) -> int:
        return blocks[pos // self.bs] * self.bs + pos % self.bs

    def _propose(self, toks) -> list[int]:
        chain = list(toks)
        for _ in range(K):
            chain.append(target(chain) if self.rng.random() < self.agree else 7 + self.rng.randrange(3))
        return chain[len(toks):]

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for nr in out.new_requests:
            self.tokens[nr.req_id] = list(nr.prompt_token_ids)
        for rid in out.finished_req_ids:
            self.tokens.pop(rid, None)
        for rid, n in out.preempted_req_ids.items():
            del self.tokens[rid][self.s.requests[rid].num_prompt_tokens + n:]
        sampled, spec = {}, {}
        for ch in out.chunks:
            toks = self.tokens[ch.req_id]
            n_draft = ch.num_draft_tokens
            assert n_draft == 0 or out.kind == "decode"
            real = ch.token_ids[:len(ch.token_ids) - n_draft]
            end = ch.start_pos + len(ch.token_ids)
            assert end <= self.s.config.max_model_len
            assert real == toks[ch.start_pos:ch.start_pos + len(real)]
            assert len(ch.block_ids) * self.bs >= end
            for p in range(ch.start_pos):  # verified context only
                assert self.kv.get(self.slot(ch.block_ids, p)) == tuple(toks[:p + 1]), \
                    f"{ch.req_id}: K/V of position {p} missing or stale (rollback?)"
            written = toks[:ch.start_pos] + list(ch.token_ids)
            for p in range(ch.start_pos, end):
                b = ch.block_ids[p // self.bs]
                assert self.s.kv.pool.ref_cnt[b] == 1, f"{ch.req_id} writes shared block {b}"
                self.kv[self.slot(ch.block_ids, p)] = tuple(written[:p + 1])
            if not ch.sample:
                continue
            self.max_drafts_seen = max(self.max_drafts_seen, n_draft)
            drafts = ch.token_ids[len(ch.token_ids) - n_draft:]
            emitted = []
            for d in drafts:
                t = target(toks + emitted)
                emitted.append(t)
                if d != t:
                    break
            else:
                emitted.append(target(toks + emitted))
            toks.extend(emitted)
            sampled[ch.req_id] = emitted
            spec[ch.req_id] = self._propose(toks)
        return ModelRunnerOutput(sampled, spec_token_ids=spec)


def spec_make(**kw) -> Scheduler:
    base = make(**kw).config
    return Scheduler(SchedulerConfig(**{**base.__dict__, "num_speculative_tokens": K}))


def run(sched: Scheduler, requests, agree=1.0, seed=0) -> Driver:
    d = Driver(sched)
    d.runner = FakeSpecRunner(sched, agree, seed)
    for r in requests:
        sched.add_request(r)
    d.run(5000)
    return d


def expected(prompt, n) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(target(toks))
    return toks[len(prompt):]


@pytest.mark.parametrize("agree", [1.0, 0.5, 0.0])
def test_outputs_equal_the_target_alone_and_blocks_come_back(agree):
    s = spec_make(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_blocks=64)
    prompts = {f"r{i}": prompt_of(i, 5 + 7 * i) for i in range(4)}
    d = run(s, [req(rid, p, max_tokens=20 + i) for i, (rid, p) in enumerate(prompts.items())], agree)
    for i, (rid, p) in enumerate(prompts.items()):
        assert d.outputs[rid] == expected(p, 20 + i), rid
    st = s.spec_stats
    assert st.num_drafts > 0 and d.runner.max_drafts_seen == K
    if agree == 1.0:
        assert st.num_accepted_tokens == st.num_draft_tokens and st.mean_accepted_length > 3
        assert len(d.steps) < 4 * 21 / 3  # far fewer steps than tokens
    if agree == 0.0:
        assert st.acceptance_rate < 0.35  # only a chance hit on the target
    assert st.accepted_per_pos[0] >= st.accepted_per_pos[1] >= st.accepted_per_pos[2]
    assert_all_blocks_free(s)


def test_drafts_never_pass_max_tokens_or_max_model_len():
    s = spec_make(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=24, num_blocks=32)
    d = run(s, [req("a", prompt_of(1, 10), max_tokens=5), req("b", prompt_of(2, 16), max_tokens=50)])
    assert d.outputs["a"] == expected(prompt_of(1, 10), 5)
    assert d.outputs["b"] == expected(prompt_of(2, 16), 8)  # capped by max_model_len 24
    assert d.finished["b"][1] == "length"
    assert_all_blocks_free(s)


def test_rollback_trims_blocks_of_rejected_positions():
    s = spec_make(max_num_seqs=1, max_num_batched_tokens=32, max_model_len=64, block_size=2, num_blocks=40)
    r = req("a", prompt_of(3, 7), max_tokens=30)
    d = Driver(s)
    d.runner = FakeSpecRunner(s, agree=0.0)
    s.add_request(r)
    while s.has_unfinished():
        d.step()
        if r.status.name == "RUNNING":
            # Only verified positions (plus nothing) keep blocks; the next step allocates afresh.
            assert len(s.kv.block_table("a")) == -(-r.num_computed_tokens // 2)
            assert r.num_computed_tokens == r.num_tokens - 1
    assert d.outputs["a"] == expected(prompt_of(3, 7), 30)


def test_prefix_cache_hashes_only_verified_tokens():
    """A second request with the first one's prompt + outputs as its prompt hits the cache for the
    verified blocks; a stale block (holding a rejected draft) would fail the fake runner's KV check."""
    s = spec_make(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=96, block_size=4, num_blocks=64)
    p = prompt_of(5, 9)
    d = run(s, [req("a", p, max_tokens=30)], agree=0.4, seed=3)
    full = p + d.outputs["a"]
    s.add_request(req("b", full, max_tokens=6))
    d.run()
    assert s.requests == {} and d.outputs["b"] == expected(full, 6)
    first_b = next(c for o in d.steps for c in o.chunks if c.req_id == "b")
    assert first_b.start_pos == (len(full) - 1) // 4 * 4  # every full verified block was a hit


preempted: list[int] = []


@pytest.mark.parametrize("seed", range(6))
def test_preemption_and_random_workloads(seed):
    rng = random.Random(seed)
    mml = rng.choice([32, 48])
    bs = [2, 4, 8][seed % 3]
    s = spec_make(max_num_seqs=rng.randint(2, 5), max_num_batched_tokens=rng.choice([8, 16, 64]), max_model_len=mml,
                  block_size=bs, num_blocks=-(-mml // bs) + 1 + rng.randint(0, 6), caching=seed % 2 == 0)
    reqs, want = [], {}
    for n in range(12):
        p = prompt_of(rng.randint(0, 2), mml)[:rng.randint(1, mml - 2)]
        mt = rng.randint(1, mml - len(p))
        reqs.append(req(f"q{n}", p, max_tokens=mt))
        want[f"q{n}"] = expected(p, mt)
    d = run(s, reqs, agree=rng.choice([0.3, 0.8, 1.0]), seed=seed)
    assert d.outputs == want
    preempted.append(s.num_preemptions)
    assert_all_blocks_free(s)


def test_random_workloads_did_preempt():
    assert sum(preempted) > 0


def test_tokens_verified_past_a_stop_token_are_not_the_requests():
    """A verification that accepts EOS among its drafts emits tokens after it: the request ends at EOS
    and `num_new_tokens` tells the engine how many of the step's tokens to output."""
    s = spec_make()
    eos = 2
    s.add_request(req("a", prompt_of(1, 6), max_tokens=20, eos=eos))
    first = s.schedule()
    assert not s.update(first, ModelRunnerOutput({"a": [11]}, {}, spec_token_ids={"a": [12, eos, 13]}))
    step = s.schedule()
    assert step.chunks[0].num_draft_tokens == K
    (fin,) = s.update(step, ModelRunnerOutput({"a": [12, eos, 13, 14]}, {}))
    assert fin.finish_reason == "stop" and fin.num_new_tokens == 2
    assert fin.request.output_token_ids == [11, 12, eos]
    assert_all_blocks_free(s)


def test_rejected_drafts_pause_the_request_and_output_is_unchanged():
    """Drafts that are never accepted: after a window of rounds the request decodes without drafts (and is
    left out of `spec_req_ids`, so no runner proposes for it) except for rare probes."""
    s = spec_make(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=256, num_blocks=128)
    d = Driver(s)
    d.runner = FakeSpecRunner(s, agree=0.0)
    # Drafts outside the target's range (1000..1012): never accepted, not even by chance.
    d.runner._propose = lambda toks: [7] * K
    p = prompt_of(4, 10)
    s.add_request(req("a", p, max_tokens=200))
    d.run(5000)
    assert d.outputs["a"] == expected(p, 200)
    decodes = [o for o in d.steps if o.kind == "decode"]
    verifies = [o for o in decodes if o.chunks[0].num_draft_tokens]
    # 8 rounds, then pauses of 8, 16, 32, 64 steps each followed by one probe.
    assert s.spec_policy.num_pauses >= 4 and 8 < len(verifies) <= 13, len(verifies)
    assert any(o.spec_req_ids == [] for o in decodes) and any(o.spec_req_ids == ["a"] for o in decodes)


@pytest.mark.parametrize("agree", [1.0, 0.8])  # 0.8 per draft: about 65% of K=3 drafts accepted
def test_good_drafts_keep_speculating(agree):
    s = spec_make(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=256, num_blocks=128)
    p = prompt_of(4, 10)
    d = run(s, [req("a", p, max_tokens=150)], agree=agree)
    assert d.outputs["a"] == expected(p, 150)
    decodes = [o for o in d.steps if o.kind == "decode"]
    plain = sum(not o.chunks[0].num_draft_tokens for o in decodes)
    if agree == 1.0:  # every step verifies, but a last one with one token left to emit (no room for drafts)
        assert s.spec_policy.num_pauses == 0 and plain <= 1
    else:  # a streak of rejected rounds may pause it briefly; a good probe resumes it
        assert plain < 0.25 * len(decodes), (plain, len(decodes))


def test_disable_by_batch_size_drops_drafts_while_the_batch_is_large(caplog):
    base = make(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, num_blocks=64).config
    s = Scheduler(SchedulerConfig(**{**base.__dict__, "num_speculative_tokens": K, "spec_disable_by_batch_size": 3}))
    prompts = {f"r{i}": prompt_of(i, 6) for i in range(4)}
    lengths = {"r0": 8, "r1": 12, "r2": 30, "r3": 40}
    with caplog.at_level("INFO", logger="vllm_neuron"):
        d = run(s, [req(rid, p, max_tokens=lengths[rid]) for rid, p in prompts.items()])
    assert all(d.outputs[r] == expected(p, lengths[r]) for r, p in prompts.items())
    decodes = [o for o in d.steps if o.kind == "decode"]
    big = [o for o in decodes if len(o.chunks) >= 3]
    small = [o for o in decodes if len(o.chunks) < 3]
    assert big and small
    assert not any(c.num_draft_tokens for o in big for c in o.chunks)
    assert all(o.spec_req_ids == [] for o in big)
    assert sum(c.num_draft_tokens for o in small for c in o.chunks) > 0
    assert sum("disable_by_batch_size=3" in r.message for r in caplog.records) == 1
