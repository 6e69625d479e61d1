"""Typed view of a Hugging Face gpt-oss config: Llama's fields plus experts, SwiGLU clamp, layer windows."""
from __future__ import annotations

from dataclasses import dataclass

from vllm_neuron.model.llama.config import LlamaArchConfig, layer_windows


@dataclass(frozen=True)
class GptOssArchConfig(LlamaArchConfig):
    num_experts: int = 0
    top_k: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None: full attention

    @classmethod
    def from_hf(cls, hf, family: str = "gpt-oss", **extra) -> "GptOssArchConfig":
        return super().from_hf(
            hf, family=family, num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
            swiglu_alpha=float(hf.swiglu_alpha), swiglu_limit=float(hf.swiglu_limit),
            sliding_windows=layer_windows(hf, family), **extra)
