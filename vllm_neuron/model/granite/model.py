"""IBM Granite 3.x dense (GraniteForCausalLM): Llama's layout with four multipliers from the config -
`embedding_multiplier` on the input embeddings (prompt embeddings included, like transformers),
`attention_multiplier` as the attention scale (instead of head_dim ** -0.5), `residual_multiplier` on each
attention and MLP output before it joins the residual stream, and the logits divided by `logits_scaling`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vllm_neuron.model.layer_region import layer_region
from vllm_neuron.model.layers.attention import AttentionMetadata
from vllm_neuron.model.llama.config import LlamaArchConfig
from vllm_neuron.model.llama.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


@dataclass(frozen=True)
class GraniteArchConfig(LlamaArchConfig):
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @classmethod
    def from_hf(cls, hf, family: str = "Granite", **extra) -> "GraniteArchConfig":
        return super().from_hf(hf, family=family, embedding_multiplier=float(hf.embedding_multiplier),
                               attention_multiplier=float(hf.attention_multiplier),
                               residual_multiplier=float(hf.residual_multiplier),
                               logits_scaling=float(hf.logits_scaling), **extra)


class GraniteAttention(LlamaAttention):
    def __init__(self, cfg: GraniteArchConfig) -> None:
        super().__init__(cfg)
        self.scale = cfg.attention_multiplier


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: GraniteArchConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.residual_multiplier = cfg.residual_multiplier

    def make_attention(self, cfg: GraniteArchConfig, layer_idx: int) -> nn.Module:
        return GraniteAttention(cfg)

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        return _granite_layer(self, x, cos, sin, kv_cache[0], kv_cache[1], *meta.fields())


@layer_region
def _granite_layer(layer: GraniteDecoderLayer, x, cos, sin, k_cache, v_cache, *meta_fields) -> torch.Tensor:
    meta = AttentionMetadata(*meta_fields)
    m = layer.residual_multiplier
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, (k_cache, v_cache), meta) * m
    return x + layer.mlp(layer.post_attention_layernorm(x)) * m


class GraniteModel(LlamaModel):
    def __init__(self, cfg: GraniteArchConfig, hf_config, layer_cls: type[GraniteDecoderLayer]) -> None:
        super().__init__(cfg, hf_config, layer_cls)
        self.embedding_multiplier = cfg.embedding_multiplier

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None, aux_layers: tuple[int, ...] = (),
                lora_index=None):
        if lora_index is not None:
            raise ValueError("Granite does not take LoRA adapters yet")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        return super().forward(input_ids, positions, kv_caches, meta, x * self.embedding_multiplier, aux_layers)


class GraniteForCausalLM(LlamaForCausalLM):
    layer_cls = GraniteDecoderLayer
    arch_cls = GraniteArchConfig
    takes_lora = False  # model/layers/lora.py refuses enable_lora
    model_cls = GraniteModel

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.arch.logits_scaling
