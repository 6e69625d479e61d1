"""Each engine decides its kernels once and hands them to the model it builds: two engines with different
kernel settings in one process each keep their own (a process-wide switch once let the second engine's
choice leak into the first one's graphs)."""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import build_tiny_llama, generate_token_ids, hf_greedy_reference, tiny_llm
from vllm_neuron import LLM, SamplingParams
from vllm_neuron.model.layers import linear
from vllm_neuron.model.layers.kernel_config import KernelConfig
from vllm_neuron.model.layers.kernels.cpu_caps import kernels_enabled

pytestmark = [pytest.mark.engine, pytest.mark.skipif(not kernels_enabled(torch.device("cpu")),
                                                     reason="the custom CPU kernels did not build")]

PROMPTS = [[1, 523, 8091, 77, 3001, 12], [1, 9, 4000, 4001]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _engine(model_dir: str) -> LLM:
    return tiny_llm(model_dir, max_model_len=128, max_num_seqs=2, num_gpu_blocks_override=32)


def _layers_kernels(llm: LLM) -> set[KernelConfig]:
    return {m.kernels for m in llm.llm_engine.core.runner.model.modules() if isinstance(m, linear.Linear)}


def test_two_engines_with_different_kernel_settings_keep_their_own(tiny_llama_512_dir, monkeypatch):
    calls = []
    kernel = linear.linear_small_batch
    monkeypatch.setattr(linear, "linear_small_batch", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    with_kernels = _engine(tiny_llama_512_dir)
    monkeypatch.setenv("VLLM_NEURON_DISABLE_NKI_KERNELS", "1")
    without = _engine(tiny_llama_512_dir)
    monkeypatch.delenv("VLLM_NEURON_DISABLE_NKI_KERNELS")

    on, off = with_kernels.llm_engine.core.runner.kernels, without.llm_engine.core.runner.kernels
    assert on.attention and on.linear_rows > 0 and off == KernelConfig()
    assert _layers_kernels(with_kernels) == {on} and _layers_kernels(without) == {off}

    reference, _ = hf_greedy_reference(build_tiny_llama(max_position_embeddings=512), PROMPTS, 5, logits=False)
    assert generate_token_ids(without, PROMPTS, PARAMS) == reference
    assert not calls  # the engine built without kernels never calls one
    assert generate_token_ids(with_kernels, PROMPTS, PARAMS) == reference
    assert calls  # built second, the engine without kernels did not switch the first one's off
