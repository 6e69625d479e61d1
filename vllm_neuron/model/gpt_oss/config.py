"""Typed view of a Hugging Face gpt-oss config: Llama's fields plus experts, SwiGLU clamp, layer windows."""
from __future__ import annotations

from dataclasses import dataclass

from vllm_neuron.model.llama.config import LlamaArchConfig


@dataclass(frozen=True)
class GptOssArchConfig(LlamaArchConfig):
    num_experts: int = 0
    top_k: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None: full attention

    @classmethod
    def from_hf(cls, hf, family: str = "gpt-oss", **extra) -> "GptOssArchConfig":
        n = hf.num_hidden_layers
        types = list(getattr(hf, "layer_types", None) or ["full_attention"] * n)
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown or len(types) != n:
            raise ValueError(f"gpt-oss layer_types {types} are not supported; each of the {n} layers must be "
                             f"'sliding_attention' or 'full_attention'")
        window = getattr(hf, "sliding_window", None)
        if "sliding_attention" in types and not window:
            raise ValueError("gpt-oss layer_types has sliding_attention layers but sliding_window is not set")
        return super().from_hf(
            hf, family=family, num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
            swiglu_alpha=float(hf.swiglu_alpha), swiglu_limit=float(hf.swiglu_limit),
            sliding_windows=tuple(int(window) if t == "sliding_attention" else None for t in types), **extra)
