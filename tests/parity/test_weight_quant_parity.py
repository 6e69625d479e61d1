"""Weight-only int8 / int4 (neuron_config.quantization) against transformers holding the same rounded
weights, fp32: the quantization is the only difference from the fp32 model, so the engine's greedy tokens
must equal a reference whose linear weights were quantized and dequantized alike (eager and compiled;
decode takes the few-row kernels, prompts longer than a prefill bucket the dequantize + matmul path)."""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import build_tiny_llama, greedy_reference, make_tiny_llama
from vllm_neuron import LLM, SamplingParams
from vllm_neuron.model.layers import quant_int4, quant_int8

pytestmark = pytest.mark.engine

MAX_NEW = 8
PROMPTS = [[(7 * i + 3 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate([5, 12, 40, 70])]
CFG = dict(max_position_embeddings=256)
SCHEMES = {"int8": quant_int8, "int4": quant_int4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("quant_llama")), **CFG)


def _greedy(hf) -> list[list[int]]:
    return greedy_reference(hf, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    exact = _greedy(build_tiny_llama(**CFG))
    out = {}
    for name, mod in SCHEMES.items():
        hf = build_tiny_llama(**CFG)
        with torch.no_grad():
            for module in hf.modules():
                if isinstance(module, torch.nn.Linear):
                    module.weight = torch.nn.Parameter(mod.dequantize(*mod.quantize(module.weight), torch.float32))
        out[name] = _greedy(hf)
    # The rounding shows in the tokens: an engine ignoring the option would fail.
    assert out["int4"] != exact and out["int8"] != exact
    return out


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("eager", [True, False])
def test_greedy_matches_transformers_with_rounded_weights(model_dir, references, scheme, eager, tmp_path,
                                                          monkeypatch):
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    llm = LLM(model_dir, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
              dtype="float32", device="cpu", num_gpu_blocks_override=128, enforce_eager=eager,
              additional_config={"neuron_config": {"quantization": scheme, "num_batched_tokens_buckets": [64],
                                                   "num_seqs_buckets": [4],
                                                   # the weights alone (int8 activations: test_w4a8_parity.py)
                                                   "int8_activations": False}})
    model = llm.llm_engine.core.runner.model
    assert model.lm_head.quantization == scheme and model.model.layers[0].mlp.down_proj.quantization == scheme
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == references[scheme]
