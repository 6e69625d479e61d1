"""Speculative decoding end to end (tiny random Llama, fp32, MRv1): greedy output is token-identical with
speculation on and off across batch buckets, segmented prefill, prefix caching and preemption; a draft
that agrees with the target is accepted nearly always, a random one almost never; random sampling
through the verification graph follows the target's distribution.

The tiny random target never copies its context, so n-gram lookup rarely proposes anything: the
both-ends tests swap in an oracle proposer (the target's own greedy continuation, from a run without
speculation) or a random one. The n-gram path itself runs in the compiled test.
"""
from __future__ import annotations

import functools
import json
import random
from collections import Counter, defaultdict

import pytest
import torch

from tests.model_factory import build_tiny_llama, make_tiny_llama, make_tiny_model, shared_prefix_prompts, tiny_llm
from vllm_neuron import LLM, SamplingParams
from vllm_neuron.worker.spec_decode.ngram import NgramSpeculator

pytestmark = pytest.mark.engine

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_NEW = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("spec_llama")), max_position_embeddings=256)


BUCKETS = {"neuron_config": {"num_seqs_buckets": [2, 4, 8]}}


def _engine(model_dir, monkeypatch, spec=True, **kw) -> LLM:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return tiny_llm(model_dir, speculative_config=NGRAM if spec else None, **{"additional_config": BUCKETS, **kw})


def _prompts() -> list[list[int]]:
    # Lengths over the 32-token prefill budget (segmented prefill); the last four share a prefix of
    # four 16-token blocks (prefix-cache hits once the first of them has run).
    return shared_prefix_prompts([5, 17, 40, 70, 90, 130, 130, 131, 128], 128, 5, seed=3)


def _gen(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(model_dir) -> dict[tuple, list[int]]:
    mp = pytest.MonkeyPatch()
    try:
        llm = _engine(model_dir, mp, spec=False)
        prompts = _prompts()
        return {tuple(p): out for p, out in zip(prompts, _gen(llm, prompts, GREEDY))}
    finally:
        mp.undo()


def _oracle(reference, agree: bool):
    rng = random.Random(0)

    def propose(self, states, req_ids, rows, graph_drafts):
        out = {}
        for rid in req_ids:
            st = states[rid]
            n = len(st.output_token_ids)
            ref = reference.get(tuple(st.data.prompt_token_ids), [])
            out[rid] = list(ref[n:n + self.k]) if agree else [rng.randrange(3, 49152) for _ in range(self.k)]
        return {r: d for r, d in out.items() if d}
    return propose


@pytest.mark.parametrize("agree", [True, False], ids=["agreeing_draft", "random_draft"])
def test_greedy_identical_and_acceptance_at_both_ends(model_dir, reference, monkeypatch, agree):
    monkeypatch.setattr(NgramSpeculator, "propose", _oracle(reference, agree))
    llm = _engine(model_dir, monkeypatch)
    core = llm.llm_engine.core
    assert not core.config.use_v2_model_runner and not core.async_scheduling
    buckets = Counter()
    orig = core.runner.execute

    def spy(sched):
        out = orig(sched)
        buckets[out.bucket_name] += 1
        return out
    core.runner.execute = spy
    prompts = _prompts()
    assert _gen(llm, prompts, GREEDY) == [reference[tuple(p)] for p in prompts]
    st = core.scheduler.spec_stats
    assert st.num_drafts > 0
    if agree:
        assert st.acceptance_rate > 0.95 and st.mean_accepted_length > 3.5
        assert st.accepted_per_pos[0] > 0.95 * st.num_drafts  # later positions: fewer drafts near max_tokens
    else:
        assert st.acceptance_rate < 0.05 and st.mean_accepted_length < 1.1
    # Several verification buckets served, and the prefix cache was hit.
    assert len({b for b in buckets if b.startswith("verify_b")}) >= 2, buckets
    assert core.scheduler.kv.prefix_hits > 0
    assert not core.has_unfinished() and core.scheduler.kv.pool.num_free_blocks == core.num_blocks - 1


def test_gpt_oss_kv_cache_groups_greedy_identical(tmp_path, monkeypatch):
    # Sliding-window layers in their own KV cache group: verification writes and reads each group's blocks,
    # rejected drafts are trimmed from both, and out-of-window blocks are given back meanwhile.
    model = make_tiny_model(str(tmp_path / "gpt_oss"), "gpt_oss", max_position_embeddings=256)
    prompts = _prompts()[3:8]
    ref_llm = _engine(model, monkeypatch, spec=False)
    reference = {tuple(p): out for p, out in zip(prompts, _gen(ref_llm, prompts, GREEDY))}
    monkeypatch.setattr(NgramSpeculator, "propose", _oracle(reference, True))
    llm = _engine(model, monkeypatch)
    core = llm.llm_engine.core
    assert core.scheduler.kv.windows == (None, 24)
    assert _gen(llm, prompts, GREEDY) == [reference[tuple(p)] for p in prompts]
    st = core.scheduler.spec_stats
    assert st.num_drafts > 0 and st.acceptance_rate > 0.95
    assert core.scheduler.kv.prefix_hits > 0
    assert core.scheduler.kv.pool.num_free_blocks == core.num_blocks - 1


def test_greedy_identical_under_preemption(model_dir, reference, monkeypatch):
    monkeypatch.setattr(NgramSpeculator, "propose", _oracle(reference, True))
    # 16 usable blocks of 16 tokens (one max_model_len request): long prompts cannot all stay resident.
    llm = _engine(model_dir, monkeypatch, num_gpu_blocks_override=17)
    prompts = _prompts()
    assert _gen(llm, prompts, GREEDY) == [reference[tuple(p)] for p in prompts]
    core = llm.llm_engine.core
    assert core.scheduler.num_preemptions > 0 and core.scheduler.spec_stats.num_accepted_tokens > 0
    assert core.scheduler.kv.pool.num_free_blocks == core.num_blocks - 1


def test_random_sampling_follows_the_target(model_dir, monkeypatch):
    """Seeded temperature sampling: the first token verified after the prefill's token, drawn through the
    rejection sampler with the target's argmax as the draft, is distributed as the target's own top-3
    distribution (transformers logits of the same weights); chi-square over 300 seeds."""
    prompt = [11, 523, 8091, 77, 3001]
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s, max_tokens=3, ignore_eos=True) for s in range(300)]
    hf = build_tiny_llama(max_position_embeddings=256)

    @functools.lru_cache(maxsize=None)  # t1 takes one of 3 values
    @torch.no_grad()
    def target(t1: int) -> torch.Tensor:
        logits = hf(torch.tensor([prompt + [t1]])).logits[0, -1]
        top = torch.topk(logits, 3)
        p = torch.zeros_like(logits)
        p[top.indices] = torch.softmax(top.values, -1)
        return p

    def propose(self, states, req_ids, rows, graph_drafts):  # the target's argmax: accepted often, the residual matters
        return {rid: [int(target(states[rid].output_token_ids[0]).argmax())] for rid in req_ids
                if len(states[rid].output_token_ids) == 1}
    monkeypatch.setattr(NgramSpeculator, "propose", propose)
    llm = _engine(model_dir, monkeypatch, max_num_seqs=32, max_num_batched_tokens=256,
                  additional_config={"neuron_config": {"num_seqs_buckets": [32]}})
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params)
    by_t1: dict[int, Counter] = defaultdict(Counter)
    for o in outs:
        t1, t2 = o.outputs[0].token_ids[:2]
        by_t1[t1][t2] += 1
    chi2 = dof = 0
    for t1, counts in by_t1.items():
        p = target(t1)
        n = sum(counts.values())
        assert set(counts) <= set(torch.nonzero(p).flatten().tolist())
        for tok in torch.nonzero(p).flatten().tolist():
            e = float(p[tok]) * n
            chi2 += (counts[tok] - e) ** 2 / e
            dof += 1
    st = llm.llm_engine.core.scheduler.spec_stats
    assert st.num_drafts == len(params) and 0.2 < st.acceptance_rate < 0.95
    # dof - len(by_t1) degrees of freedom (one constraint per group): 6 here; 30 is p ~ 5e-5.
    assert dof - len(by_t1) <= 6 and chi2 < 30, (chi2, dof, dict(by_t1))


@pytest.mark.slow
def test_ngram_compiled_graphs(model_dir, monkeypatch, tmp_path):
    """Compiled buckets with the real n-gram proposer on prompts whose text repeats: the verification
    graph is compiled at warm-up next to the decode graph and the output equals the non-speculative one."""
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    kw = dict(enforce_eager=False, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64, num_gpu_blocks_override=64,
              additional_config={"neuron_config": {"num_batched_tokens_buckets": [64], "num_seqs_buckets": [2]}})
    prompts = [[40, 41, 42, 43] * 6, [900, 901, 902] * 5 + [7]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    off = _gen(_engine(model_dir, monkeypatch, spec=False, **kw), prompts, params)
    llm = _engine(model_dir, monkeypatch, **kw)
    core = llm.llm_engine.core
    assert [r.name for r in core.compiler.records] == ["prefill_s64", "decode_b2", "verify_b2_k3"]
    # Seed the histories so that lookup finds matches: each prompt followed by its own greedy output.
    seeded = [p + o + p for p, o in zip(prompts, off)]
    ref = _gen(_engine(model_dir, monkeypatch, spec=False, **kw), seeded, params)
    assert _gen(llm, seeded, params) == ref
    assert core.scheduler.spec_stats.num_drafts > 0


def test_grammar_requests_speculate_and_host_sampled_ones_share_their_batches(model_dir, monkeypatch):
    """Grammar-constrained requests speculate: every verified position is masked (the matcher walks the
    drafts and rolls back), and their output equals the non-speculative one, with drafts that the grammar
    allows (accepted) and one it refuses (rejected) in every step. Host-sampled (logprobs, penalties)
    requests get no drafts, one token per step in the same verification steps."""
    from vllm_neuron.structured_output import StructuredOutputsParams
    from vllm_neuron.worker.spec_decode import ngram

    plain = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    grammar = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(
                   choice=["alpha beta gamma delta", "gamma"])),
               SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(
                   json=schema))]
    host = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.3)]
    texts = ["Answer:", "Say something", "x y z", "Answer:", "JSON:", "Say something", "x y z"]
    params = [plain] * 3 + grammar + host
    off = _engine(model_dir, monkeypatch, spec=False).generate(texts, params, use_tqdm=False)
    full = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in off[:5]]

    def oracle(tokens, lo, hi, k):  # each request's own continuation, the last draft replaced by junk
        for f in full:
            if f[:len(tokens)] == list(tokens) and len(f) > len(tokens):
                return f[len(tokens):len(tokens) + k - 1] + [5]
        return [5, 6, 7][:k]
    monkeypatch.setattr(ngram, "propose_ngram", oracle)
    llm = _engine(model_dir, monkeypatch)
    core = llm.llm_engine.core
    drafted, steps = Counter(), Counter()
    orig = core.runner.execute

    def spy(sched):
        for c in sched.chunks:
            drafted[c.req_id] += c.num_draft_tokens
            steps[c.req_id] += sched.kind == "decode"
        return orig(sched)
    core.runner.execute = spy
    on = llm.generate(texts, params, use_tqdm=False)
    ids = [o.request_id for o in on]
    assert all(drafted[r] > 0 for r in ids[:5]) and not any(drafted[r] for r in ids[5:]), drafted
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert on[3].outputs[0].text in ("alpha beta gamma delta", "gamma") and on[3].outputs[0].finish_reason == "stop"
    if on[4].outputs[0].finish_reason == "stop":
        json.loads(on[4].outputs[0].text)
    for o in on[3:5]:  # accepted drafts: fewer decode steps than tokens after the first
        n = len(o.outputs[0].token_ids)
        assert n < 4 or steps[o.request_id] < n - 1, (o.outputs[0].text, steps[o.request_id])
    assert len(on[4].outputs[0].token_ids) > 8
    assert len(on[5].outputs[0].logprobs) == MAX_NEW


def test_greedy_identical_while_the_policy_pauses_and_resumes(model_dir, monkeypatch):
    """Drafts right for 8 tokens, junk for the next 8, and so on: with a short window the policy pauses
    each request mid-output (plain decode steps, no proposals for it) and resumes it on a good probe; the
    tokens equal the run without speculation."""
    from vllm_neuron.core.spec_policy import SpecPolicy

    prompts = _prompts()[1:3]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = {tuple(p): o for p, o in zip(prompts, _gen(_engine(model_dir, monkeypatch, spec=False), prompts, params))}
    proposed, sampled = Counter(), Counter()

    def propose(self, states, req_ids, rows, graph_drafts):
        out = {}
        for rid in req_ids:
            proposed[rid] += 1
            n = len(states[rid].output_token_ids)
            good = list(ref[tuple(states[rid].data.prompt_token_ids)][n:n + self.k])
            out[rid] = good if (n // 8) % 2 == 0 else [5] * self.k
        return {r: d for r, d in out.items() if d}
    monkeypatch.setattr(NgramSpeculator, "propose", propose)
    llm = _engine(model_dir, monkeypatch)
    core = llm.llm_engine.core
    core.scheduler.spec_policy = policy = SpecPolicy(window=2, initial_backoff=2, max_backoff=4)
    kinds = Counter()
    orig = core.runner.execute

    def spy(sched):
        out = orig(sched)
        sampled.update(c.req_id for c in sched.chunks if c.sample)
        if sched.kind == "decode":
            kinds[out.bucket_name.split("_")[0]] += 1
        return out
    core.runner.execute = spy
    assert _gen(llm, prompts, params) == [ref[tuple(p)] for p in prompts]
    assert policy.num_pauses >= len(prompts) and policy.num_resumes >= len(prompts), (policy.num_pauses,
                                                                                       policy.num_resumes)
    assert kinds["decode"] > 0 and kinds["verify"] > 0, kinds
    # While paused a request gets no proposals: fewer than its sampling steps.
    assert all(proposed[r] < sampled[r] for r in sampled), (proposed, sampled)
