"""Greedy tokens and logits of our engine vs transformers on the same tiny random Llama (fp32).

Exercises what must never change greedy output: padding to buckets, several buckets in one run,
concurrent requests, segmented prefill (prompts longer than max_num_batched_tokens), prefix caching
on and off (and a second pass answered from the cache), eager and compiled graphs.
"""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import build_tiny_llama, make_tiny_llama, shared_prefix_prompts
from vllm_neuron import LLM, SamplingParams

MAX_NEW = 10
# Lengths around block (16) and bucket (32/64/128) edges, and beyond max_num_batched_tokens (128).
LENGTHS = [3, 15, 16, 17, 33, 64, 65, 100, 129, 200, 300]
SHARED = 80  # prompts 6.. share an 80-token prefix with each other


def _prompts() -> list[list[int]]:
    return shared_prefix_prompts(LENGTHS, SHARED, first_shared=6, seed=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("parity_llama")), max_position_embeddings=512)


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers greedy generate, one prompt at a time (no padding), and its per-step logprobs."""
    hf = build_tiny_llama(max_position_embeddings=512).eval()
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in _prompts():
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=2)
            tokens.append(out.sequences[0, len(p):].tolist())
            logprobs.append(torch.log_softmax(torch.stack(out.logits)[:, 0].float(), -1))
    return tokens, logprobs


def _engine(model_dir: str, **kw) -> LLM:
    base = dict(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128, block_size=16, dtype="float32",
                device="cpu", num_gpu_blocks_override=512)
    base.update(kw)
    return LLM(model_dir, **base)


def _run(llm: LLM, logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return outs


def _assert_tokens(outs, ref_tokens) -> None:
    for i, (o, ref) in enumerate(zip(outs, ref_tokens)):
        assert o.outputs[0].token_ids == ref, f"prompt {i} (length {LENGTHS[i]}) diverged"


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_eager_greedy_matches_transformers(model_dir, reference, prefix_caching):
    llm = _engine(model_dir, enforce_eager=True, enable_prefix_caching=prefix_caching)
    _assert_tokens(_run(llm), reference[0])
    # Second pass: with prefix caching every prompt now starts from cached blocks.
    core = llm.llm_engine.core
    hits_before = core.scheduler.kv.prefix_hits
    _assert_tokens(_run(llm), reference[0])
    assert (core.scheduler.kv.prefix_hits > hits_before) == prefix_caching
    # Every block is free again once all requests are done.
    assert core.scheduler.kv.pool.num_free_blocks == core.num_blocks - 1


def test_logprobs_match_transformers_logits(model_dir, reference):
    llm = _engine(model_dir, enforce_eager=True)
    outs = _run(llm, logprobs=5)
    worst = 0.0
    for o, ref_lp in zip(outs, reference[1]):
        for step, entry in enumerate(o.outputs[0].logprobs):
            for tok, lp in entry.items():
                worst = max(worst, abs(lp.logprob - ref_lp[step, tok].item()))
            top5 = torch.topk(ref_lp[step], 5).indices.tolist()
            assert set(top5) <= set(entry), "top-5 tokens differ from transformers"
    print(f"max |logprob - transformers| = {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.parametrize("kernels", [True, False])
def test_small_buckets_force_padding_and_segments(model_dir, reference, kernels, monkeypatch):
    # Tiny prefill buckets: every prompt above 32 tokens is segmented, decode batches are padded; the
    # custom paged-attention kernel and the pure-torch path (gather + SDPA) must agree token for token.
    monkeypatch.setenv("VLLM_NEURON_DISABLE_NKI_KERNELS", "0" if kernels else "1")
    llm = _engine(model_dir, enforce_eager=True, max_num_batched_tokens=32, max_num_seqs=4,
                  additional_config={"neuron_config": {"num_batched_tokens_buckets": [8, 32],
                                                       "num_seqs_buckets": [1, 4],
                                                       "decode_context_length_buckets": [128, 256]}})
    assert llm.llm_engine.core.runner.use_kernels == kernels
    _assert_tokens(_run(llm), reference[0])


@pytest.mark.parametrize("kernels", [True, False])
def test_compiled_matches_transformers(model_dir, reference, tmp_path, monkeypatch, kernels):
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_NEURON_DISABLE_NKI_KERNELS", "0" if kernels else "1")
    llm = _engine(model_dir, enforce_eager=False, max_num_seqs=4,
                  additional_config={"neuron_config": {"num_batched_tokens_buckets": [64, 128],
                                                       "num_seqs_buckets": [2, 4]}})
    compiler = llm.llm_engine.core.compiler
    # 2 prefill + 2 decode graphs; the torch path adds a cached-context variant of each prefill bucket.
    assert compiler.backend == "native" and len(compiler.records) == (4 if llm.llm_engine.core.runner.use_kernels
                                                                      else 6)
    _assert_tokens(_run(llm), reference[0])
