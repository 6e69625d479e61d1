"""GGUF files of Gemma 3, Phi-3, Granite, Qwen3-MoE, DeepSeek-V2 and gpt-oss (as llama.cpp's converter writes them)
load into the same model as the transformers checkpoint they came from: the same arch config, parameters and rotary
tables. (That model's tokens equal transformers': tests/parity/test_model_parity.py; gpt-oss's end to end here.)"""
from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import torch
from transformers import AutoTokenizer

from tests.gguf_family_factory import make_family_gguf, make_gpt_oss_gguf
from tests.model_factory import greedy_reference, smollm2_tokenizer_dir, tiny_llm
from vllm_neuron.model.loader import load_checkpoint, load_tokenizer
from vllm_neuron.model.loader import gguf_cache
from vllm_neuron.model.loader.gguf_loader import gguf_config, iter_gguf_weights
from vllm_neuron.model.registry import resolve_model_class
from vllm_neuron.worker.gguf_weights import log_gguf_weights

CASES = {
    # Real Gemma 3 files leave query_pre_attn_scalar implicit (the head size below 27B), so the twin uses it.
    "gemma3": dict(query_pre_attn_scalar=16),
    "phi3": dict(max_position_embeddings=512),  # LongRoPE factors as tensors, partial rotary
    "granite": {},
    "qwen3_moe": {},  # stacked expert tensors, yielded per expert
    # MLA as one latent KV head in the metadata, kv_b_proj split into k_b / v_b, yarn's mscale as a log multiplier,
    # shared experts and a dense first layer; rope rows as the checkpoint holds them (the model permutes at load).
    "deepseek_v2": {},
}


def _assert_same_arch(model, twin) -> None:
    ours, theirs = dataclasses.asdict(model.arch), dataclasses.asdict(twin.arch)
    for key, value in theirs.items():  # GGUF keeps float metadata in float32
        assert ours[key] == (pytest.approx(value, rel=1e-6) if isinstance(value, float) else value), key


def _ours(cfg, weights):
    model = resolve_model_class(cfg)(cfg)
    model.load_weights(weights)
    return model


@pytest.mark.parametrize("arch", list(CASES))
def test_gguf_loads_the_model_its_checkpoint_does(arch, tmp_path):
    path, hf = make_family_gguf(str(tmp_path / f"{arch}.gguf"), arch, **CASES[arch])
    cfg = gguf_config(path)
    assert cfg.architectures == hf.config.architectures
    from_gguf = _ours(cfg, iter_gguf_weights(path, cfg))
    from_hf = _ours(hf.config, hf.state_dict().items())
    _assert_same_arch(from_gguf, from_hf)
    params = dict(from_hf.named_parameters())
    for name, p in from_gguf.named_parameters():
        # Gemma's norms went through the file as 1 + w: equal to float32 rounding, the rest bit for bit.
        assert torch.allclose(p, params[name], rtol=0, atol=1e-6 if name.endswith("norm.weight") else 0), name
    buffers = dict(from_hf.named_buffers())
    for name, b in from_gguf.named_buffers():
        assert torch.equal(b, buffers[name]), name  # rotary tables (per layer type, LongRoPE), KV scales


def test_gguf_gemma3_default_pattern_and_quantized_weights(tmp_path):
    # Six layers in Gemma 3's own every-6th pattern (not written to the file) and Q8_0 matrices.
    types = ["sliding_attention"] * 5 + ["full_attention"]
    path, hf = make_family_gguf(str(tmp_path / "g.gguf"), "gemma3", quant="Q8_0", num_hidden_layers=6,
                                layer_types=types, query_pre_attn_scalar=16)
    cfg = gguf_config(path)
    assert cfg.layer_types == types and cfg.sliding_window == 24
    model = _ours(cfg, iter_gguf_weights(path, cfg))
    ref = _ours(hf.config, hf.state_dict().items())
    q = model.model.layers[5].self_attn.qkv_proj.weight
    assert torch.allclose(q, ref.model.layers[5].self_attn.qkv_proj.weight, atol=0.05) and not torch.equal(
        q, ref.model.layers[5].self_attn.qkv_proj.weight)  # Q8_0's rounding, dequantized


def test_gguf_deepseek2_older_layout_q_lora_and_grouped_routing(tmp_path):
    # kv_b_proj whole (attn_kv_b, the converters before the k_b / v_b split), V2's q LoRA (attn_q_a / _norm / _b)
    # and its group-limited routing (expert_group_count / _used_count); a V3-style sigmoid router is refused.
    kw = dict(q_lora_rank=16, n_group=2, topk_group=1, topk_method="group_limited_greedy")
    path, hf = make_family_gguf(str(tmp_path / "ds.gguf"), "deepseek_v2", split_kv_b=False, **kw)
    cfg = gguf_config(path)
    assert (cfg.q_lora_rank, cfg.n_group, cfg.topk_group, cfg.topk_method) == (16, 2, 1, "group_limited_greedy")
    model, ref = _ours(cfg, iter_gguf_weights(path, cfg)), _ours(hf.config, hf.state_dict().items())
    params = dict(ref.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    v3, _ = make_family_gguf(str(tmp_path / "v3.gguf"), "deepseek_v2", scoring_func="sigmoid", num_hidden_layers=1)
    with pytest.raises(ValueError, match="expert_gating_func=2"):
        gguf_config(v3)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe", "deepseek_v2"])
def test_gguf_conversion_cache_keeps_the_new_configs_and_expert_tensors(arch, tmp_path, monkeypatch):
    # The conversion cache stores the config as JSON and the weights as safetensors: Gemma 3's nested rope and
    # layer types must read back the same, and the per-expert pieces of a stacked tensor must be writable.
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    path, _ = make_family_gguf(str(tmp_path / f"{arch}.gguf"), arch, **CASES[arch])
    cfg, _ = gguf_cache.load_configs(path)
    first = list(gguf_cache.iter_weights(path, cfg))
    entry = gguf_cache.cache_dir(path)
    assert os.path.isfile(os.path.join(entry, "config.json"))
    assert os.path.isfile(os.path.join(entry, gguf_cache.weights_file_name(None)))
    cached_cfg, _ = gguf_cache.load_configs(path)
    assert cached_cfg.to_dict() == cfg.to_dict()
    again = list(gguf_cache.iter_weights(path, cached_cfg))
    assert [n for n, _ in again] == [n for n, _ in first]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, again))


def test_gguf_tokenizer_of_an_architecture_transformers_does_not_map(tmp_path, monkeypatch):
    # transformers' GGUF reader refuses `granite` before it reaches the tokenizer metadata (llama.cpp's common
    # keys): the same conversion then builds the tokenizer; it encodes and renders chats like the original.
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    path, _ = make_family_gguf(str(tmp_path / "granite.gguf"), "granite", tokenizer=True)
    tok, ref = load_tokenizer(path), AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())
    text = "Hello there, <|im_start|>user\n how are you? 123"
    assert tok(text).input_ids == ref(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False)


def test_gguf_gpt_oss_mxfp4_experts_kept_packed_or_dequantized(tmp_path, monkeypatch, caplog):
    # llama.cpp's MXFP4 blocks read back as the checkpoint's packed _blocks / _scales: what gguf's own dequantize
    # makes of the file equals what ours makes of them; the model keeps them packed under "mxfp4" (bit for bit the
    # checkpoint's) and dequantizes them otherwise; gate / up halves interleaved back; sinks, yarn, windows.
    import gguf

    from vllm_neuron.model.layers.mxfp4 import dequantize_mxfp4
    from vllm_neuron.model.loader.gguf_loader import mxfp4_blocks, open_gguf

    path, hf, packed = make_gpt_oss_gguf(str(tmp_path / "gpt-oss.gguf"), swiglu_limit=7.0)  # llama.cpp's fixed limit
    t = next(t for t in open_gguf(path).tensors if t.name == "blk.1.ffn_gate_exps.weight")
    theirs = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(8, 32, 64)
    assert torch.equal(dequantize_mxfp4(*mxfp4_blocks(t), torch.float32), theirs)
    cfg = gguf_config(path)
    assert cfg.layer_types == ["sliding_attention", "full_attention"] and cfg.sliding_window == 24
    checkpoint = [(n + suffix, x) for n, t in hf.state_dict().items()
                  for suffix, x in (zip(("_blocks", "_scales"), packed[n]) if n in packed else (("", t),))]
    for quantization in (None, "mxfp4"):
        cls = resolve_model_class(cfg)
        ours, ref = cls(cfg, quantization), cls(hf.config, quantization)
        ours.load_weights(iter_gguf_weights(path, cfg))
        ref.load_weights(iter(checkpoint))
        _assert_same_arch(ours, ref)
        theirs = dict(ref.state_dict())
        assert theirs.keys() == ours.state_dict().keys()
        for name, x in ours.state_dict().items():
            assert x.dtype == theirs[name].dtype and torch.equal(x, theirs[name]), (quantization, name)
    # The conversion cache keeps the packed blocks (uint8) under the checkpoint's names.
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    ck = load_checkpoint(path)
    f32 = torch.float32  # the blocks stay uint8 in a float cache
    first, again = (list(gguf_cache.iter_weights(path, ck.hf_config, f32)) for _ in range(2))
    assert os.path.isfile(os.path.join(gguf_cache.cache_dir(path), gguf_cache.weights_file_name(f32)))
    assert [n for n, _ in again] == [n for n, _ in first]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, again))
    assert dict(first)["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8
    with caplog.at_level(logging.INFO):
        log_gguf_weights(ck, torch.float32, None, {}, {}, ("mxfp4",))
        log_gguf_weights(ck, torch.float32, None, {}, {}, ("mxfp4",), packed_mxfp4=True)
    said = [r.getMessage() for r in caplog.records[-2:]]
    assert "'mxfp4' would keep the MXFP4 experts packed" in said[0] and "experts held in MXFP4" in said[1]



def test_gguf_gpt_oss_float_experts(tmp_path):
    # A file whose experts the converter wrote unquantized (a bf16 checkpoint's): gate / up interleaved back and
    # transposed to transformers' layout; the model dequantized equals its checkpoint twin.
    path, hf, _ = make_gpt_oss_gguf(str(tmp_path / "f.gguf"), mxfp4=False, swiglu_limit=7.0)
    cfg = gguf_config(path)
    model, ref = _ours(cfg, iter_gguf_weights(path, cfg)), _ours(hf.config, hf.state_dict().items())
    params = dict(ref.named_parameters())
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())


@pytest.mark.engine
def test_gguf_gpt_oss_serves_transformers_tokens_with_packed_experts(tmp_path):
    # End to end: the tokenizer from the file (transformers' own gpt-oss GGUF reader fails on llama.cpp's rope keys),
    # the conversion cache, the experts packed: greedy tokens equal transformers' on the same weights.
    from vllm_neuron import SamplingParams

    path, hf, _ = make_gpt_oss_gguf(str(tmp_path / "g.gguf"), tokenizer=True, swiglu_limit=7.0,
                                    max_position_embeddings=512)
    prompts = [[1, 5, 9, 300, 42, 17], list(range(100, 140))]  # the second over one 32-token prefill chunk
    llm = tiny_llm(path, additional_config={"neuron_config": {"quantization": "mxfp4"}})
    try:
        experts = llm.llm_engine.core.runner.model.model.layers[0].mlp.experts
        assert dict(experts.named_parameters())["gate_up_proj_blocks"].dtype == torch.uint8
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        assert [list(o.outputs[0].token_ids) for o in outs] == greedy_reference(hf, prompts, 8)
    finally:
        llm.llm_engine.shutdown()
