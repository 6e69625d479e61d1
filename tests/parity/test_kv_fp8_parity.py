"""FP8 KV cache (kv_cache_dtype fp8 / fp8_e5m2), fp32 compute: the engine's greedy tokens equal transformers
running an attention that applies the same quantize (clamped) / dequantize to K and V with the
checkpoint's per-layer scales (ModelOpt `k_proj.k_scale` names), through the custom kernel and the torch
paths, eager and compiled; and FP8 KV stays close to the unquantized cache."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_factory import build_tiny_llama, hf_greedy_reference, make_tiny_llama, tiny_llm
from vllm_neuron import LLM, SamplingParams
from vllm_neuron.model.layers import kv_quant

pytestmark = pytest.mark.engine

MAX_NEW = 8
PROMPTS = [[(7 * i + 3 * j) % 4000 + 10 for j in range(n)] for i, n in enumerate([5, 12, 40, 70])]
CFG = dict(max_position_embeddings=256)
LAYERS = 2
# Small scales put the larger K/V values past E4M3's 448 after division: the clamp is exercised too.
K_SCALES, V_SCALES = [0.011, 0.02], [0.004, 0.0075]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    plain = make_tiny_llama(str(tmp_path_factory.mktemp("fp8kv_plain")), **CFG)
    scaled = make_tiny_llama(str(tmp_path_factory.mktemp("fp8kv_scaled")), **CFG)
    path = os.path.join(scaled, "model.safetensors")
    tensors = load_file(path)
    for i in range(LAYERS):
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(K_SCALES[i])
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(V_SCALES[i])
    save_file(tensors, path, metadata={"format": "pt"})
    return {"plain": plain, "scaled": scaled}


def _fp8_attention(cache_dtype: torch.dtype, k_scales: list[float], v_scales: list[float]):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        ks, vs = torch.tensor(k_scales[module.layer_idx]), torch.tensor(v_scales[module.layer_idx])
        key = kv_quant.dequantize(kv_quant.quantize(key, ks, cache_dtype), ks, key.dtype)
        value = kv_quant.dequantize(kv_quant.quantize(value, vs, cache_dtype), vs, value.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return attention


def _greedy(hf) -> tuple[list[list[int]], list[torch.Tensor]]:
    return hf_greedy_reference(hf, PROMPTS, MAX_NEW)


def _reference(cache_dtype, k_scales, v_scales):
    from transformers import AttentionInterface

    name = f"fp8kv_test_{str(cache_dtype)[6:]}"
    AttentionInterface.register(name, _fp8_attention(cache_dtype, k_scales, v_scales))
    hf = build_tiny_llama(**CFG)
    hf.set_attn_implementation(name)
    return _greedy(hf)


def _engine(model_dir, kv_cache_dtype, eager, tmp_path, monkeypatch, kernels=True):
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "cache"))
    if not kernels:
        monkeypatch.setenv("VLLM_NEURON_DISABLE_NKI_KERNELS", "1")
    return tiny_llm(model_dir, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=128,
                    enforce_eager=eager, kv_cache_dtype=kv_cache_dtype,
                    additional_config={"neuron_config": {"num_batched_tokens_buckets": [64], "num_seqs_buckets": [4]}})


def _run(llm, logprobs: int | None = None):
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=logprobs),
                        use_tqdm=False)


@pytest.mark.parametrize("kv_cache_dtype, cache_dtype, eager, kernels", [
    ("fp8", torch.float8_e4m3fn, True, True),
    ("fp8_e4m3", torch.float8_e4m3fn, True, False),
    ("fp8_e5m2", torch.float8_e5m2, True, True),
    ("fp8_e5m2", torch.float8_e5m2, True, False),
    ("fp8", torch.float8_e4m3fn, False, True),
])
def test_greedy_equals_the_quantize_dequantize_reference(model_dirs, kv_cache_dtype, cache_dtype, eager, kernels,
                                                         tmp_path, monkeypatch):
    ref_tokens, _ = _reference(cache_dtype, K_SCALES, V_SCALES)
    unscaled, _ = _reference(cache_dtype, [1.0] * LAYERS, [1.0] * LAYERS)
    assert ref_tokens != unscaled  # the scales matter: an engine ignoring them would fail
    llm = _engine(model_dirs["scaled"], kv_cache_dtype, eager, tmp_path, monkeypatch, kernels)
    runner = llm.llm_engine.core.runner
    assert runner.kv_caches[0][0].dtype == cache_dtype and runner.kernels.attention == kernels
    attn = runner.model.model.layers[1].self_attn
    assert float(attn.k_scale) == pytest.approx(K_SCALES[1]) and float(attn.v_scale) == pytest.approx(V_SCALES[1])
    assert [o.outputs[0].token_ids for o in _run(llm)] == ref_tokens


def test_fp8_kv_stays_close_to_the_unquantized_cache(model_dirs, tmp_path, monkeypatch):
    # Measured on this tiny random model (unit-scale weights, scales 1.0): E4M3 keeps the first 3 greedy
    # tokens of every prompt (one prompt diverges at its 4th) and the chosen tokens' log-probabilities
    # within 0.03 of the unquantized cache's.
    exact_tokens, exact_logits = _greedy(build_tiny_llama(**CFG))
    llm = _engine(model_dirs["plain"], "fp8", True, tmp_path, monkeypatch)
    outs = _run(llm, logprobs=1)
    for out, tokens, logits in zip(outs, exact_tokens, exact_logits):
        c = out.outputs[0]
        assert c.token_ids[:3] == tokens[:3]
        for i in range(3):  # the chosen token's log-probability, fp8 KV vs the exact cache
            exact = torch.log_softmax(logits[i].float(), -1)[tokens[i]].item()
            assert abs(c.logprobs[i][tokens[i]].logprob - exact) < 0.05


def test_the_same_budget_holds_twice_the_blocks(model_dirs, tmp_path, monkeypatch):
    from vllm_neuron.worker import memory

    monkeypatch.setattr(memory, "host_available_bytes", lambda *a, **k: 64 << 20)  # the same budget for both
    monkeypatch.setenv("VLLM_NEURON_MIN_KV_BUDGET_GIB", "0")
    blocks = {}
    for kv_cache_dtype in ("auto", "fp8"):
        monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / kv_cache_dtype))
        llm = LLM(model_dirs["plain"], max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, block_size=16,
                  dtype="bfloat16", device="cpu", enforce_eager=True, kv_cache_dtype=kv_cache_dtype,
                  additional_config={"neuron_config": {"num_batched_tokens_buckets": [64], "num_seqs_buckets": [4]}})
        blocks[kv_cache_dtype] = llm.llm_engine.core.num_blocks
        del llm
    assert blocks["fp8"] == 2 * blocks["auto"]
