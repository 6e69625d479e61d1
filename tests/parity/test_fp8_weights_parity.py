"""FP8 static weights from a ModelOpt-format checkpoint written here (config.json quantization_config plus
float8_e4m3fn weights with `weight_scale` / `input_scale` tensors and lm_head left unquantized): it loads with
no flag, keeps FP8 weights in memory, and its fp32 greedy tokens equal transformers running the dequantized
weights (eager and compiled). Any other scheme in quantization_config fails at start-up naming it."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_factory import build_tiny_llama, greedy_reference, make_tiny_llama, tiny_llm
from vllm_neuron import SamplingParams
from vllm_neuron.model.layers import quant_fp8

pytestmark = pytest.mark.engine

MAX_NEW = 8
PROMPTS = [[(7 * i + 3 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate([5, 12, 40, 70])]
CFG = dict(max_position_embeddings=256)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _set_quantization_config(path: str, qc: dict) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> str:
    path = make_tiny_llama(str(tmp_path_factory.mktemp("modelopt_fp8")), **CFG)
    st = os.path.join(path, "model.safetensors")
    tensors = load_file(st)
    for name in list(tensors):
        if name.endswith(".weight") and name.split(".")[-2] in PROJ:
            w8, scale = quant_fp8.quantize(tensors[name])
            tensors[name] = w8
            tensors[name[:-len("weight")] + "weight_scale"] = scale
            tensors[name[:-len("weight")] + "input_scale"] = torch.tensor(0.0173)
    save_file(tensors, st, metadata={"format": "pt"})
    _set_quantization_config(path, {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]})
    return path


@pytest.fixture(scope="module")
def reference(fp8_dir) -> list[list[int]]:
    hf = build_tiny_llama(**CFG)
    exact = _greedy(hf)
    tensors = load_file(os.path.join(fp8_dir, "model.safetensors"))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name + "_scale" in tensors:
                p.copy_(quant_fp8.dequantize(tensors[name], tensors[name + "_scale"], torch.float32))
    out = _greedy(hf)
    assert out != exact  # the FP8 rounding shows in the tokens: reading the weights wrong would fail
    return out


def _greedy(hf) -> list[list[int]]:
    return greedy_reference(hf, PROMPTS, MAX_NEW)


def _llm(path, eager=True, **extra):
    return tiny_llm(path, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=128, enforce_eager=eager,
                    additional_config={"neuron_config": {"num_batched_tokens_buckets": [64], "num_seqs_buckets": [4],
                                                         **extra}})


@pytest.mark.parametrize("eager", [True, False])
def test_modelopt_fp8_checkpoint_matches_transformers_on_the_dequantized_weights(fp8_dir, reference, eager, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    llm = _llm(fp8_dir, eager)
    model = llm.llm_engine.core.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.quantization == "fp8" and qkv.weight.dtype == torch.float8_e4m3fn
    assert len(set(qkv.weight_scale.tolist())) == 3  # q, k and v keep their own scales on their rows
    assert model.lm_head.quantization is None and model.lm_head.weight.dtype == torch.float32  # excluded
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_unsupported_schemes_fail_at_startup_naming_them(tmp_path, fp8_dir):
    path = make_tiny_llama(str(tmp_path / "gptq"), **CFG)
    _set_quantization_config(path, {"quant_method": "gptq", "bits": 4, "group_size": 128})
    with pytest.raises(ValueError, match="requests 'gptq'.*does not support"):
        _llm(path)
    _set_quantization_config(path, {"quant_method": "compressed-tensors", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float"}, "targets": ["Linear"]}}})
    with pytest.raises(ValueError, match="'compressed-tensors'.*only its kv_cache_scheme"):
        _llm(path)
    # KV-cache scales only: accepted (the FP8 KV cache reads them).
    _set_quantization_config(path, {"quant_method": "compressed-tensors", "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}})
    assert _llm(path).llm_engine.core.runner.model.lm_head.quantization is None
    with pytest.raises(ValueError, match="quantization='int8' cannot apply to a checkpoint whose weights are already"):
        _llm(fp8_dir, quantization="int8")
