"""The model contract: registry by `architectures`, weight loading errors, quantization support."""
from __future__ import annotations

import pytest
import torch

from tests.model_factory import build_tiny_llama, tiny_llama_config
from vllm_neuron.model.base import CausalLM, ModelSpec
from vllm_neuron.model.registry import check_quantization, resolve_model_class, supported_architectures


def _small(**kw):
    return tiny_llama_config(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                             num_key_value_heads=2, num_hidden_layers=2, **kw)


def test_unsupported_architecture_names_itself_and_the_supported_list():
    cfg = _small()
    cfg.architectures = ["MambaForCausalLM"]
    with pytest.raises(ValueError) as e:
        resolve_model_class(cfg)
    assert "MambaForCausalLM" in str(e.value)
    for arch in supported_architectures():
        assert arch in str(e.value)


def test_every_registered_class_keeps_the_contract():
    for arch in supported_architectures():
        cfg = _small()
        cfg.architectures = [arch]
        cls = resolve_model_class(cfg)
        assert issubclass(cls, CausalLM)
        for name in ("spec", "forward", "compute_logits", "load_weights"):
            assert callable(getattr(cls, name))


def _hf_state(**kw):
    hf = build_tiny_llama(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=2, **kw)
    return hf.config, list(hf.state_dict().items())


def _ours(cfg):
    return resolve_model_class(cfg)(cfg)


def test_loads_a_transformers_state_dict_exactly():
    cfg, state = _hf_state()
    model = _ours(cfg)
    assert model.load_weights(state) > 0
    ours = dict(model.named_parameters())
    q = dict(state)["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(ours["model.layers.1.self_attn.qkv_proj.weight"][:q.shape[0]], q)
    assert isinstance(model.spec(cfg), ModelSpec) and model.spec(cfg).num_layers == 2


def test_mismatched_tensor_is_named():
    cfg, state = _hf_state()
    bad = [(n, t[:-1] if n == "model.layers.0.self_attn.k_proj.weight" else t) for n, t in state]
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape"):
        _ours(cfg).load_weights(bad)


def test_unknown_and_missing_tensors_are_named():
    cfg, state = _hf_state()
    with pytest.raises(ValueError, match="'model.layers.0.mlp.experts.0.w1' has no matching parameter"):
        _ours(cfg).load_weights(state + [("model.layers.0.mlp.experts.0.w1", torch.zeros(1))])
    partial = [(n, t) for n, t in state if n != "model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks tensors for parameters: \['model\.layers\.1\.mlp\.gate_up_proj"):
        _ours(cfg).load_weights(partial)


def test_quantization_the_model_does_not_support_is_refused():
    cfg = _small()
    cls = resolve_model_class(cfg)
    check_quantization(cls, cls.spec(cfg), "int4")
    with pytest.raises(ValueError, match="quantization='mxfp4' is not supported for LlamaForCausalLM.*gpt-oss"):
        check_quantization(cls, cls.spec(cfg), "mxfp4")
