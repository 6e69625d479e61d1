"""A quantized GGUF with neuron_config.quantization int8 / int4: the file's dequantized linear weights are
re-quantized onto our weight-only kernels, and the error against them is measured and logged.

With "int4", a layer holding a tensor the file keeps finer than 4 bits (a Q4_K_M file's Q6_K / Q8_0 ones, a tied
lm_head's Q8_0 embedding) is re-quantized to int8 instead (worker/gguf_weights.py).

Bounds (from the formats): int8 moves a weight by at most half a step of its row (largest |w| / 254), int4 by half
a step of its 32-wide group ((max - min) / 30, so at most 1/15 of the tensor's largest |w|). A Q4_1 file uses
int4's own block (32 weights, w = d * q + m with q 0..15 over the block's full range) and comes back exact to
float32 rounding, so an engine serving it with int4 gives the dequantized model's greedy tokens.
"""
from __future__ import annotations

import logging

import pytest
import torch

from tests.model_factory import build_tiny_llama, greedy_reference, make_tiny_gguf, smollm2_tokenizer_dir, tiny_llm
from vllm_neuron import SamplingParams
from vllm_neuron.model.layers import quant_error, quant_int4, quant_int8
from vllm_neuron.model.layers.linear import Linear, quantize_linears_
from vllm_neuron.model.loader import load_checkpoint
from vllm_neuron.model.loader.gguf_loader import suggested_quantization
from vllm_neuron.model.loader.gguf_cache import hf_types
from vllm_neuron.model.registry import resolve_model_class
from vllm_neuron.worker.gguf_weights import layer_schemes, log_gguf_weights

SHAPE = dict(arch="qwen3", num_hidden_layers=1, hidden_size=256, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=512, tokenizer=False, seed=5)
BOUND = {"int8": 1 / 254, "int4": 1 / 15}  # relative to the tensor's largest |w|
SCHEMES = {"int8": quant_int8, "int4": quant_int4}


def _linears(weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = torch.nn.Module()
    for i, (name, w) in enumerate(sorted(weights.items())):
        lin = Linear(w.shape[1], w.shape[0], bias=False)
        lin.weight.data.copy_(w)
        model.add_module(f"m{i}", lin)
    return model


@pytest.mark.parametrize("qtype, scheme", [("Q8_0", "int8"), ("Q6_K", "int8"), ("Q5_K", "int8"), ("Q4_0", "int4"),
                                           ("Q4_1", "int4"), ("Q4_K", "int4"), ("IQ4_XS", "int4")])
def test_requantized_error_against_the_dequantized_weights_is_measured_and_bounded(tmp_path, monkeypatch, qtype,
                                                                                   scheme):
    monkeypatch.setattr(quant_error, "ROWS", 8)  # measured in row blocks: several per tensor here
    ck = load_checkpoint(make_tiny_gguf(str(tmp_path / f"{qtype}.gguf"), quant=qtype, **SHAPE))
    weights = {n: t for n, t in ck.iter_weights(torch.float32) if t.ndim == 2 and "embed" not in n}
    model = _linears(weights)
    originals = {n: m.weight.detach().clone() for n, m in model.named_children()}
    errors: dict = {}
    quantize_linears_(model, scheme, errors)
    assert set(errors) == set(originals)
    for name, m in model.named_children():
        back = SCHEMES[scheme].dequantize(m.qweight, m.qscale, torch.float32)
        diff = (back - originals[name]).abs().max().item()
        assert errors[name].max_abs == pytest.approx(diff, abs=0)  # what is logged is the error
        assert errors[name].rel == pytest.approx(diff / originals[name].abs().max().item())
        assert 0 <= errors[name].rel <= BOUND[scheme] + 1e-6, (name, errors[name])
    if qtype == "Q4_1":
        assert max(e.rel for e in errors.values()) < 1e-6  # int4 holds Q4_1's blocks
    else:
        assert max(e.rel for e in errors.values()) > 1e-4  # a real re-quantization, not a copy


def test_the_default_dequantization_is_said_with_the_scheme_that_would_keep_the_file_quantized(tmp_path, caplog):
    assert suggested_quantization({"F32": 10, "Q4_K": 6, "Q6_K": 1}) == "int4"
    assert suggested_quantization({"F32": 10, "Q8_0": 7}) == "int8"
    assert suggested_quantization({"F32": 3, "Q6_K": 7, "Q4_K": 2}) == "int8"
    assert suggested_quantization({"F32": 10, "BF16": 7}) is None
    ck = load_checkpoint(make_tiny_gguf(str(tmp_path / "q.gguf"), quant="Q4_0", tokenizer=False, vocab_size=512))
    with caplog.at_level(logging.INFO):
        log_gguf_weights(ck, torch.bfloat16, None, {}, {}, ("int8", "int4"))
        log_gguf_weights(ck, torch.float32, None, {}, {}, ("int8",))  # e.g. Qwen3-MoE refuses int4: no hint
    assert ("GGUF tensors (Q4_0 x16, F32 x5) dequantized to bfloat16; neuron_config.quantization 'int4' would "
            "re-quantize") in caplog.text
    assert caplog.records[-1].getMessage() == "GGUF tensors (Q4_0 x16, F32 x5) dequantized to float32"


def test_int4_keeps_the_layers_a_mixed_file_holds_finer_at_int8(tmp_path):
    # A Q4_K_M-like mix: most matrices 4-bit, attn_v / ffn_down and the (tied) embedding at 8 bits.
    path = make_tiny_gguf(str(tmp_path / "mix.gguf"), quant="Q4_0", tokenizer=False, vocab_size=512,
                          tie_word_embeddings=True,
                          quant_by_name={"attn_v": "Q8_0", "ffn_down": "Q8_0", "token_embd": "Q8_0"})
    ck = load_checkpoint(path)
    model = resolve_model_class(ck.hf_config)(ck.hf_config)
    model.load_weights(ck.iter_weights(torch.float32))
    assert layer_schemes(model, hf_types(path), "int8") == {}
    schemes = layer_schemes(model, hf_types(path), "int4")
    layers = range(ck.hf_config.num_hidden_layers)
    # q/k/v run as one fused layer: its Q8_0 v rows make all of it int8; the tied lm_head holds the Q8_0 embedding.
    assert schemes == {"lm_head": "int8", **{f"model.layers.{i}.{m}": "int8" for i in layers
                                             for m in ("self_attn.qkv_proj", "mlp.down_proj")}}
    errors: dict = {}
    quantize_linears_(model, "int4", errors, schemes)
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            assert module.quantization == schemes.get(name, "int4"), name
            assert errors[name].rel <= BOUND[module.quantization] + 1e-6, name
    assert {m.quantization for n, m in model.named_modules() if n.endswith(("o_proj", "gate_up_proj"))} == {"int4"}


@pytest.mark.engine
def test_a_q4_1_gguf_on_int4_gives_the_dequantized_models_greedy_tokens(tmp_path, caplog):
    cfg = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, seed=9)
    path = make_tiny_gguf(str(tmp_path / "q41.gguf"), quant="Q4_1", tokenizer=False, **cfg)
    ref_model = build_tiny_llama(**cfg)
    missing, unexpected = ref_model.load_state_dict(dict(load_checkpoint(path).iter_weights(torch.float32)),
                                                    strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the file leaves the head out
    prompts = [[1, 17, 250, 33, 401, 9], [1, 300, 12]]
    want = greedy_reference(ref_model, prompts, 8)
    with caplog.at_level(logging.INFO):
        # Full-precision activations: the weights are what this test checks (W4A8: test_w4a8_parity.py).
        llm = tiny_llm(path, additional_config={"neuron_config": {"quantization": "int4", "int8_activations": False}},
                       tokenizer=smollm2_tokenizer_dir())
        try:
            out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        finally:
            llm.llm_engine.shutdown()
    assert [list(o.outputs[0].token_ids) for o in out] == want
    line = next(r.getMessage() for r in caplog.records if "re-quantized to int4" in r.getMessage())
    assert "Q4_1 x" in line and "error relative to each tensor's largest |w|" in line
