"""Mistral (7B v0.1-v0.3, Ministral-style configs): Llama's layout, and a sliding window over every layer when
the config sets `sliding_window` (or per layer through `layer_types`), served by the KV cache groups like
gpt-oss's windows (`kv_cache_groups.py`). v0.2 and later set no window: then it is Llama."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_neuron.model.layer_region import layer_region
from vllm_neuron.model.llama.config import LlamaArchConfig, layer_windows
from vllm_neuron.model.llama.model import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                           decoder_layer_body)


@dataclass(frozen=True)
class MistralArchConfig(LlamaArchConfig):
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None: full attention

    @classmethod
    def from_hf(cls, hf, family: str = "Mistral", **extra) -> "MistralArchConfig":
        # Without layer_types, v0.1's window covers every layer; one as long as the context is no window.
        windows = layer_windows(hf, family, "sliding_attention" if getattr(hf, "sliding_window", None)
                                else "full_attention")
        windows = tuple(w if w is not None and w < hf.max_position_embeddings else None for w in windows)
        return super().from_hf(hf, family=family, sliding_windows=windows, **extra)


class MistralAttention(LlamaAttention):
    def __init__(self, cfg: MistralArchConfig, layer_idx: int) -> None:
        super().__init__(cfg)
        self.sliding_window = cfg.sliding_windows[layer_idx]


class MistralDecoderLayer(LlamaDecoderLayer):
    def make_attention(self, cfg: MistralArchConfig, layer_idx: int) -> nn.Module:
        return MistralAttention(cfg, layer_idx)

    def forward(self, x, cos, sin, kv_cache, meta, lora_index=None) -> torch.Tensor:
        if self.self_attn.sliding_window is None:
            return super().forward(x, cos, sin, kv_cache, meta, lora_index)
        if lora_index is not None:
            return _lora_sliding_decoder_layer(self, x, cos, sin, kv_cache[0], kv_cache[1], lora_index,
                                               *meta.fields())
        return _sliding_decoder_layer(self, x, cos, sin, kv_cache[0], kv_cache[1], *meta.fields())


@layer_region
def _sliding_decoder_layer(layer: MistralDecoderLayer, x, cos, sin, k_cache, v_cache, *meta_fields) -> torch.Tensor:
    # The window is a constant of the traced layer: sliding layers get a region of their own.
    return decoder_layer_body(layer, x, cos, sin, k_cache, v_cache, *meta_fields)


@layer_region
def _lora_sliding_decoder_layer(layer: MistralDecoderLayer, x, cos, sin, k_cache, v_cache, lora_index,
                                *meta_fields) -> torch.Tensor:
    return decoder_layer_body(layer, x, cos, sin, k_cache, v_cache, *meta_fields, lora_index=lora_index)


class MistralForCausalLM(LlamaForCausalLM):
    layer_cls = MistralDecoderLayer

    @classmethod
    def arch_config(cls, hf_config) -> MistralArchConfig:
        return MistralArchConfig.from_hf(hf_config)
