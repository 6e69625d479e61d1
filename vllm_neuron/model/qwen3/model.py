"""Qwen3 (dense): Llama's layout plus an RMSNorm over each query and key head before RoPE.

Tied or untied embeddings and the rope theta come from the config like Llama's. Sliding-window
attention (`use_sliding_window`, off in every released Qwen3) is refused rather than ignored.
"""
from __future__ import annotations

from vllm_neuron.model.llama.config import LlamaArchConfig
from vllm_neuron.model.llama.model import LlamaForCausalLM


def check_no_sliding_window(hf_config, family: str) -> None:
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError(f"{family} with use_sliding_window=true is not supported; supported: use_sliding_window=false")


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_config(cls, hf_config) -> LlamaArchConfig:
        check_no_sliding_window(hf_config, "Qwen3")
        return LlamaArchConfig.from_hf(hf_config, family="Qwen3", qk_norm=True)
