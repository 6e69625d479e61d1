"""Hugging Face `architectures` string -> our model class (one line per architecture)."""
from __future__ import annotations

import importlib

from vllm_neuron.model.base import CausalLM, ModelSpec

_MODELS = {
    "LlamaForCausalLM": ("vllm_neuron.model.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("vllm_neuron.model.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("vllm_neuron.model.qwen3_moe", "Qwen3MoeForCausalLM"),
    "GptOssForCausalLM": ("vllm_neuron.model.gpt_oss", "GptOssForCausalLM"),
    "Qwen3VLForConditionalGeneration": ("vllm_neuron.model.qwen3_vl", "Qwen3VLForConditionalGeneration"),
}
# Configs without `architectures` (e.g. built by hand) name their family by model_type.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "gpt_oss": "GptOssForCausalLM", "qwen3_vl": "Qwen3VLForConditionalGeneration"}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(hf_config) -> type[CausalLM]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs and getattr(hf_config, "model_type", None) in _MODEL_TYPES:
        archs = [_MODEL_TYPES[hf_config.model_type]]
    for arch in archs:
        if arch in _MODELS:
            module, name = _MODELS[arch]
            return getattr(importlib.import_module(module), name)
    raise ValueError(f"model architectures {archs} are not supported; supported: {supported_architectures()}")


def is_multimodal(hf_config) -> bool:
    """Whether the architecture takes media (a vision tower beside the text tower)."""
    return bool(getattr(resolve_model_class(hf_config), "multimodal", False))


def model_spec(hf_config, quantization: str | None = None) -> ModelSpec:
    """What the checkpoint's architecture declares (raises for an unsupported one, or one that does not
    honour `quantization`)."""
    cls = resolve_model_class(hf_config)
    spec = cls.spec(hf_config)
    check_quantization(cls, spec, quantization)
    return spec


def check_quantization(cls: type[CausalLM], spec: ModelSpec, quantization: str | None) -> None:
    """neuron_config.quantization must be one the architecture honours."""
    if quantization is None or quantization in spec.quantizations:
        return
    only = " (MXFP4 is supported only for gpt-oss: GptOssForCausalLM)" if quantization == "mxfp4" else ""
    raise ValueError(f"quantization={quantization!r} is not supported for {cls.__name__}{only}; "
                     f"valid values for this model: {list(spec.quantizations)}")
