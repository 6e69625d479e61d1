"""Greedy tokens and logits of every non-Llama architecture vs transformers, on tiny random-weight
configs built with transformers' own classes (fp32). Llama has its own, larger file
(test_llama_parity.py); this one runs the same checks per architecture: segmented prefill forced by
tiny buckets, padded decode batches, a second pass served from the prefix cache, logprobs within
1e-4 of transformers' logits, and one compiled run.
"""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import build_tiny_model, make_tiny_gguf, make_tiny_model, shared_prefix_prompts
from vllm_neuron import LLM, SamplingParams

ARCHS = ["qwen3"]
MAX_NEW = 8
# Around block (16) and bucket (8/32) edges; beyond max_num_batched_tokens (32): segmented prefill.
LENGTHS = [3, 17, 40, 70, 100]
SHARED = 64  # prompts 2.. share a prefix: the second pass starts from cached blocks
SMALL_BUCKETS = {"neuron_config": {"num_batched_tokens_buckets": [8, 32], "num_seqs_buckets": [1, 4],
                                   "decode_context_length_buckets": [128]}}


def _prompts() -> list[list[int]]:
    return shared_prefix_prompts(LENGTHS, SHARED, first_shared=2, seed=3)


@pytest.fixture(scope="module", params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(arch, tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp(f"parity_{arch}")), arch, max_position_embeddings=512)


@pytest.fixture(scope="module")
def reference(arch) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers greedy generate (eager attention), one prompt at a time, and its per-step logprobs."""
    hf = build_tiny_model(arch, max_position_embeddings=512)
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in _prompts():
            out = hf.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                              output_logits=True, return_dict_in_generate=True, pad_token_id=2)
            tokens.append(out.sequences[0, len(p):].tolist())
            logprobs.append(torch.log_softmax(torch.stack(out.logits)[:, 0].float(), -1))
    return tokens, logprobs


def _engine(model_dir: str, **kw) -> LLM:
    base = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, block_size=16, dtype="float32",
                device="cpu", num_gpu_blocks_override=128, additional_config=SMALL_BUCKETS)
    base.update(kw)
    return LLM(model_dir, **base)


def _run(llm: LLM, logprobs: int | None = None):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)


def _assert_tokens(outs, ref_tokens) -> None:
    for i, (o, ref) in enumerate(zip(outs, ref_tokens)):
        assert o.outputs[0].token_ids == ref, f"prompt {i} (length {LENGTHS[i]}) diverged"


def _max_logprob_error(outs, ref_logprobs) -> float:
    worst = 0.0
    for o, ref_lp in zip(outs, ref_logprobs):
        for step, entry in enumerate(o.outputs[0].logprobs):
            for tok, lp in entry.items():
                worst = max(worst, abs(lp.logprob - ref_lp[step, tok].item()))
    return worst


def test_eager_segmented_prefill_prefix_cache_and_logits(model_dir, reference):
    llm = _engine(model_dir, enforce_eager=True)
    outs = _run(llm, logprobs=5)
    _assert_tokens(outs, reference[0])
    worst = _max_logprob_error(outs, reference[1])
    print(f"max |logprob - transformers| = {worst:.2e}")
    assert worst < 1e-4
    core = llm.llm_engine.core
    hits_before = core.scheduler.kv.prefix_hits
    _assert_tokens(_run(llm), reference[0])  # second pass: prompts start from cached blocks
    assert core.scheduler.kv.prefix_hits > hits_before
    assert core.scheduler.kv.pool.num_free_blocks == core.num_blocks - 1


def test_compiled_matches_transformers(model_dir, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    llm = _engine(model_dir, enforce_eager=False)
    assert llm.llm_engine.core.compiler.backend == "native"
    _assert_tokens(_run(llm), reference[0])


def test_qwen3_gguf_matches_its_safetensors_twin(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    kw = dict(max_position_embeddings=512, seed=11)
    gguf_file = make_tiny_gguf(str(tmp_path / "qwen3.gguf"), arch="qwen3", **kw)
    hf_dir = make_tiny_model(str(tmp_path / "qwen3_hf"), "qwen3", **kw)
    outs = [_run(_engine(path, enforce_eager=True), logprobs=3) for path in (gguf_file, hf_dir)]
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert max(abs(la[t].logprob - lb[t].logprob) for t in la) < 1e-5
