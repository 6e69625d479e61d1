"""The CUDA path's engine wiring, run on CPU: decode attention through the paged-decode op (its torch
reference stands in for the Triton kernel) and every bucket graph captured and replayed through a fake
capturer. Greedy fp32 output must equal transformers with MRv1 and MRv2, async scheduling on (tokens
passed on the device into the next replay), segmented prefill and a prefix-cache second pass."""
from __future__ import annotations

import pytest

from tests.model_factory import build_tiny_llama, greedy_reference, make_tiny_llama, shared_prefix_prompts
from tests.unit.test_cuda_graphs import FakeCapturer
from vllm_neuron import LLM, SamplingParams
from vllm_neuron.worker import runner_base
from vllm_neuron.worker.cuda_graphs import ReplayedGraph

pytestmark = pytest.mark.engine

LENGTHS = [3, 17, 40, 70, 129]
MAX_NEW = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("cuda_path_llama")), max_position_embeddings=512)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return shared_prefix_prompts(LENGTHS, 32, first_shared=2, seed=3)


@pytest.fixture(scope="module")
def reference(prompts) -> list[list[int]]:
    return greedy_reference(build_tiny_llama(max_position_embeddings=512).eval(), prompts, MAX_NEW)


@pytest.mark.parametrize("runner", ["0", "1"])  # MRv1, MRv2
def test_paged_decode_and_graph_replay_keep_greedy_parity(model_dir, prompts, reference, runner, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
    monkeypatch.setenv("VLLM_NEURON_DISABLE_NKI_KERNELS", "1")  # the CPU kernel would take decode otherwise
    capturer = FakeCapturer()
    monkeypatch.setattr(runner_base, "paged_decode_available", lambda *a: True)
    monkeypatch.setattr(runner_base, "cuda_graph_capturer", lambda device, backend: ("all", capturer))
    llm = LLM(model_dir, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
              dtype="float32", device="cpu", num_gpu_blocks_override=256, enforce_eager=True, async_scheduling=True,
              additional_config={"neuron_config": {"num_batched_tokens_buckets": [16, 64],
                                                   "num_seqs_buckets": [1, 4]}})
    runner_obj = llm.llm_engine.core.runner
    assert type(runner_obj).__name__ == ("ModelRunnerV2" if runner == "1" else "ModelRunnerV1")
    assert runner_obj.paged_decode and runner_obj.graphs.options.paged_decode
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for _ in range(2):  # the second pass prefills from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference
    graphs = list(runner_obj._bucket_graphs.values())
    assert graphs and all(isinstance(g, ReplayedGraph) for g in graphs)
    assert capturer.captures == len(graphs) and sum(g.replays for g in graphs) > 20
