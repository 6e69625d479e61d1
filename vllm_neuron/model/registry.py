"""Hugging Face `architectures` string -> our model class."""
from __future__ import annotations

import importlib

_MODELS = {
    "LlamaForCausalLM": ("vllm_neuron.model.llama", "LlamaForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(hf_config) -> type:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs and getattr(hf_config, "model_type", None) == "llama":
        archs = ["LlamaForCausalLM"]
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"model architectures {archs} are not supported; supported: {supported_architectures()}")
