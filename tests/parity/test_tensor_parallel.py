"""Tensor and expert parallelism end to end: greedy fp32 tokens at TP=2 (two processes, gloo, one thread
each) equal transformers' and TP=1's on tiny Llama, Qwen3, Qwen3-MoE and gpt-oss models, eager and compiled,
with prompts longer than max_num_batched_tokens (segmented prefill) and a second pass served from the prefix
cache; EP=2 (experts split over the ranks) equals EP=1; speculative decoding (n-gram, EAGLE3) at TP=2 keeps them.
"""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import build_tiny_model, make_tiny_model, shared_prefix_prompts
from vllm_neuron import LLM, SamplingParams

pytestmark = pytest.mark.engine

MAX_NEW = 8
LENGTHS = [3, 17, 40, 70]  # 40 and 70 exceed max_num_batched_tokens (32): segmented prefill
SHARED = 32  # prompts 2.. share two blocks: the second pass starts from cached blocks
EAGER_BUCKETS = {"num_batched_tokens_buckets": [8, 32], "num_seqs_buckets": [1, 4]}
COMPILED_BUCKETS = {"num_batched_tokens_buckets": [32], "num_seqs_buckets": [4]}  # two graphs per rank


def _prompts() -> list[list[int]]:
    return shared_prefix_prompts(LENGTHS, SHARED, first_shared=2, seed=3)


_REFS: dict[str, list[list[int]]] = {}


def _reference(arch: str) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time."""
    if arch not in _REFS:
        hf = build_tiny_model(arch, max_position_embeddings=512)
        with torch.no_grad():
            _REFS[arch] = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                       do_sample=False, pad_token_id=2)[0, len(p):].tolist() for p in _prompts()]
    return _REFS[arch]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    return {a: make_tiny_model(str(tmp_path_factory.mktemp(f"tp_{a}")), a, max_position_embeddings=512)
            for a in ("llama", "qwen3", "qwen3_moe", "gpt_oss")}


def _generate(model_dir: str, *, tp: int, eager: bool = True, cached_pass: bool = True, stats: list | None = None,
              **kw) -> tuple[list[list[int]], list[list[int]], list]:
    """Two passes over the prompts (the second from the prefix cache; none without `cached_pass`): tokens of
    each, cached token counts; the scheduler's speculative-decoding counters appended to `stats`."""
    llm = LLM(model_dir, tensor_parallel_size=tp, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              block_size=16, dtype="float32", device="cpu", num_gpu_blocks_override=64, enforce_eager=eager,
              additional_config={"neuron_config": EAGER_BUCKETS if eager else COMPILED_BUCKETS}, **kw)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in _prompts()]
        first = llm.generate(prompts, params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False) if cached_pass else []
        if stats is not None:
            stats.append(llm.llm_engine.core.scheduler.spec_stats)
    finally:
        llm.llm_engine.shutdown()
    return ([o.outputs[0].token_ids for o in first], [o.outputs[0].token_ids for o in second],
            [o.num_cached_tokens for o in second])


def _check(arch: str, first, second, cached) -> None:
    ref = _reference(arch)
    assert first == ref, f"{arch}: first pass diverged from transformers"
    assert second == ref, f"{arch}: prefix-cached pass diverged from transformers"
    assert all(c >= SHARED for c in cached[2:]), f"the second pass should hit the prefix cache: {cached}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_eager_equals_transformers_and_tp1(arch, model_dirs):
    first, second, cached = _generate(model_dirs[arch], tp=2)
    _check(arch, first, second, cached)
    if arch == "llama":
        assert _generate(model_dirs[arch], tp=1)[0] == first


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_compiled_equals_transformers(arch, model_dirs, tmp_path, monkeypatch):
    """Compiled bucket graphs with the collectives inside (each rank its own graphs and cache entries)."""
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    _check(arch, *_generate(model_dirs[arch], tp=2, eager=False))
    keys = [p for p in (tmp_path / "cache").iterdir() if (p / "key.json").is_file()]
    assert len(keys) == 2, f"one compile-cache key per rank expected, got {keys}"


def test_ep2_equals_ep1_and_transformers(model_dirs):
    """Qwen3-MoE: experts split over 2 ranks (ep_degree 2) and, without EP, each expert's intermediate
    split (ep_degree 1) give transformers' tokens, like TP=1."""
    d = model_dirs["qwen3_moe"]
    ep2 = _generate(d, tp=2, enable_expert_parallel=True)
    _check("qwen3_moe", *ep2)
    assert _generate(d, tp=2)[0] == ep2[0]
    assert _generate(d, tp=1)[0] == ep2[0]


def test_gpt_oss_tp2_and_ep2_equal_transformers_and_tp1(model_dirs):
    """gpt-oss (attention biases, sinks, sliding-window layers, biased experts with the clamped SwiGLU): TP=2
    with each expert's intermediate split (ep_degree 1) and with the experts split (EP=2) give TP=1's tokens."""
    d = model_dirs["gpt_oss"]
    tp2 = _generate(d, tp=2)
    _check("gpt_oss", *tp2)
    assert _generate(d, tp=2, enable_expert_parallel=True, cached_pass=False)[0] == tp2[0]
    assert _generate(d, tp=1, cached_pass=False)[0] == tp2[0]


def test_speculative_decoding_with_tp2_equals_transformers(model_dirs, tmp_path, monkeypatch):
    """Speculation shards with the target: verification steps run on every rank from the scheduler's drafts. N-gram
    drafts come from an oracle on rank 0 (each request's own continuation, its last draft junk: accepted and
    rejected drafts in every step); an EAGLE3 draft runs whole on both ranks. Greedy tokens stay transformers'."""
    from tests.model_factory import make_tiny_eagle3
    from vllm_neuron.worker.spec_decode.ngram import NgramSpeculator

    ref = _reference("llama")

    def propose(self, states, req_ids, rows, graph_drafts):
        out = {}
        for rid in req_ids:
            done = states[rid].output_token_ids
            r = next((r for r in ref if done and r[:len(done)] == done), None)
            if r is not None and len(done) < len(r):
                out[rid] = r[len(done):len(done) + self.k - 1] + [5]
        return out
    monkeypatch.setattr(NgramSpeculator, "propose", propose)
    stats = []
    _check("llama", *_generate(model_dirs["llama"], tp=2, stats=stats, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3}))
    draft = make_tiny_eagle3(str(tmp_path / "eagle3"), aux_layer_ids=[0, 1, 1])
    first, _, _ = _generate(model_dirs["llama"], tp=2, cached_pass=False, stats=stats, speculative_config={
        "method": "eagle3", "model": draft, "num_speculative_tokens": 3})
    assert first == ref
    ngram, eagle3 = stats
    assert 0 < ngram.num_accepted_tokens < ngram.num_draft_tokens and eagle3.num_drafts > 0
