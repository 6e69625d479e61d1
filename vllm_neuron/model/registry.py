"""Hugging Face `architectures` string -> our model class (one line per architecture)."""
from __future__ import annotations

import importlib

from vllm_neuron.model.base import CausalLM, ModelSpec

_MODELS = {
    "LlamaForCausalLM": ("vllm_neuron.model.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("vllm_neuron.model.qwen3", "Qwen3ForCausalLM"),
    "MistralForCausalLM": ("vllm_neuron.model.mistral", "MistralForCausalLM"),
    "Gemma3ForCausalLM": ("vllm_neuron.model.gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("vllm_neuron.model.phi3", "Phi3ForCausalLM"),
    "GraniteForCausalLM": ("vllm_neuron.model.granite", "GraniteForCausalLM"),
    "Qwen3MoeForCausalLM": ("vllm_neuron.model.qwen3_moe", "Qwen3MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("vllm_neuron.model.deepseek_v2", "DeepseekV2ForCausalLM"),
    "GptOssForCausalLM": ("vllm_neuron.model.gpt_oss", "GptOssForCausalLM"),
    "Qwen3VLForConditionalGeneration": ("vllm_neuron.model.qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Qwen3ASRForConditionalGeneration": ("vllm_neuron.model.qwen3_asr", "Qwen3ASRForConditionalGeneration"),
    # Bidirectional encoders: pooling models of their own (embed), never converted.
    "BertModel": ("vllm_neuron.model.bert", "BertEncoderModel"),
    "XLMRobertaModel": ("vllm_neuron.model.bert", "BertEncoderModel"),
}
# Pooling checkpoints of a generative family (config/pooler_config.py says which task each one serves): the
# family's class, converted by model/pooling_adapters.py.
_POOLING_ARCHS = {"Qwen3Model": "Qwen3ForCausalLM", "LlamaModel": "LlamaForCausalLM",
                  "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
                  "LlamaForSequenceClassification": "LlamaForCausalLM"}
_POOLING_FAMILIES = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
# Known architectures we do not serve, and why (said before the supported list).
_REFUSED = {"Gemma3ForConditionalGeneration": "Gemma 3 with its vision tower (gemma-3-4b and up) is not supported; "
                                              "its text-only form Gemma3ForCausalLM (gemma-3-1b, or a gemma3 GGUF) is"}
# Configs without `architectures` (e.g. built by hand) name their family by model_type.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "gpt_oss": "GptOssForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                "qwen3_vl": "Qwen3VLForConditionalGeneration"}


def supported_architectures() -> list[str]:
    return sorted([*_MODELS, *_POOLING_ARCHS])


def resolve_model_class(hf_config, convert: str = "none") -> type[CausalLM]:
    """The architecture's class; `convert` "embed" / "classify" (a pooling engine): that class converted."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not archs and getattr(hf_config, "model_type", None) in _MODEL_TYPES:
        archs = [_MODEL_TYPES[hf_config.model_type]]
    for arch in archs:
        arch = _POOLING_ARCHS.get(arch, arch)
        if arch in _MODELS:
            module, name = _MODELS[arch]
            cls = getattr(importlib.import_module(module), name)
            if convert == "none" or getattr(cls, "pooling_task", None) == convert:
                return cls
            if arch not in _POOLING_FAMILIES:
                raise ValueError(f"{arch} cannot run as a pooling model (convert={convert!r}); pooling serves the "
                                 f"families {list(_POOLING_FAMILIES)}")
            from vllm_neuron.model.pooling_adapters import pooling_model_class

            return pooling_model_class(cls, convert)
    why = "".join(f" ({_REFUSED[a]})" for a in archs if a in _REFUSED)
    raise ValueError(f"model architectures {archs} are not supported{why}; supported: {supported_architectures()}")


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
