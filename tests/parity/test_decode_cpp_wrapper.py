"""neuron_config.decode_cpp_wrapper: decode graphs compiled through inductor's C++ wrapper, their layers
inlined (a nested region has no C++ wrapper codegen), keep fp32 greedy parity with transformers; prefill
graphs keep the Python wrapper and the region."""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import build_tiny_llama, greedy_reference, make_tiny_llama
from vllm_neuron import LLM, SamplingParams

pytestmark = pytest.mark.engine

PROMPTS = [[(5 * i + 11 * j) % 3000 + 7 for j in range(n)] for i, n in enumerate([3, 17, 40])]
MAX_NEW = 10
CFG = dict(max_position_embeddings=256)


def test_decode_graphs_with_the_cpp_wrapper_match_transformers(tmp_path, monkeypatch):
    model_dir = make_tiny_llama(str(tmp_path / "model"), **CFG)
    hf = build_tiny_llama(**CFG)
    ref = greedy_reference(hf, PROMPTS, MAX_NEW)
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    seen: list[bool] = []
    real_compile = torch.compile

    def spy(fn, *args, options=None, **kw):  # which bucket graph asked inductor for which wrapper
        if hasattr(fn, "__self__"):  # a bucket's bound graph method, not the aot_compile probe
            seen.append(bool((options or {}).get("cpp_wrapper")))
        return real_compile(fn, *args, options=options, **kw)

    monkeypatch.setattr(torch, "compile", spy)
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
              dtype="float32", device="cpu", num_gpu_blocks_override=64,
              additional_config={"neuron_config": {"decode_cpp_wrapper": True, "num_batched_tokens_buckets": [64],
                                                   "num_seqs_buckets": [4]}})
    names = [g[0] for g in llm.llm_engine.core.runner.graph_names()]
    assert sorted(seen) == sorted(n.startswith("decode_") for n in names), (names, seen)
    assert True in seen and False in seen
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_decode_cpp_wrapper_needs_compiled_graphs(tmp_path):
    with pytest.raises(ValueError, match="decode_cpp_wrapper"):
        LLM(make_tiny_llama(str(tmp_path / "model"), **CFG), enforce_eager=True, device="cpu",
            additional_config={"neuron_config": {"decode_cpp_wrapper": True}})
    with pytest.raises(ValueError, match="decode_cpp_wrapper"):
        LLM(make_tiny_llama(str(tmp_path / "model2"), **CFG), device="cpu",
            additional_config={"neuron_config": {"decode_cpp_wrapper": "yes please"}})


def test_decode_cpp_wrapper_is_refused_off_the_cpu(tmp_path, monkeypatch):
    from vllm_neuron.config.engine_args import EngineArgs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("VLLM_NEURON_CPU_MODE", raising=False)
    with pytest.raises(ValueError, match="decode_cpp_wrapper.*CPU only"):
        EngineArgs.from_kwargs(model=make_tiny_llama(str(tmp_path / "model"), **CFG), device="cuda",
                                 additional_config={"neuron_config": {"decode_cpp_wrapper": True}})

