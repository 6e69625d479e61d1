"""Gemma 3, text only (Gemma3ForCausalLM: gemma-3-1b and the text layout of the larger ones).

Llama's paged attention and fused projections with Gemma's changes:
* RMSNorm scaling by (1 + w) (layers/norm.py GemmaRMSNorm), on q and k heads too, and four norms per
  layer: the attention and MLP outputs are normed before they join the residual stream;
* embeddings scaled by sqrt(hidden) (rounded to the compute dtype first, like transformers);
* attention scaled by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
* local (`sliding_attention`) layers see `sliding_window` positions through the KV cache groups and rotate
  with their own theta (rope_local_base_freq); global layers with rope_theta and its scaling;
* gelu (tanh approximation) gated MLP; final logit softcapping when the config sets one.
Refused: a vision tower (Gemma3ForConditionalGeneration's vision_config), bidirectional attention
(EmbeddingGemma) and attention logit softcapping (no released Gemma 3 sets it; our kernels have no softcap).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vllm_neuron.model.layer_region import layer_region
from vllm_neuron.model.layers.attention import AttentionMetadata
from vllm_neuron.model.layers.norm import GemmaRMSNorm
from vllm_neuron.model.layers.parallel import VocabParallelEmbedding, all_reduce
from vllm_neuron.model.layers.rotary import RotaryEmbedding
from vllm_neuron.model.llama.config import LlamaArchConfig, layer_windows
from vllm_neuron.model.llama.model import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


@dataclass(frozen=True)
class Gemma3ArchConfig(LlamaArchConfig):
    sliding_windows: tuple[int | None, ...] = ()  # per layer; None: a global layer
    query_pre_attn_scalar: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_hf(cls, hf, family: str = "Gemma3", **extra) -> "Gemma3ArchConfig":
        if getattr(hf, "vision_config", None) is not None:
            raise ValueError("Gemma3 with a vision tower (vision_config, Gemma3ForConditionalGeneration) is not "
                             "supported; supported: the text-only Gemma3ForCausalLM")
        if getattr(hf, "use_bidirectional_attention", False):
            raise ValueError("Gemma3 with use_bidirectional_attention=true (an embedding model) is not supported; "
                             "supported: use_bidirectional_attention=false")
        if getattr(hf, "attn_logit_softcapping", None) is not None:
            raise ValueError(f"Gemma3 attn_logit_softcapping={hf.attn_logit_softcapping} is not supported; "
                             f"supported: null (as in every released Gemma 3)")
        return super().from_hf(
            hf, family=family, activations=("gelu_pytorch_tanh",), qk_norm=True,
            sliding_windows=layer_windows(hf, family), query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
            final_logit_softcapping=getattr(hf, "final_logit_softcapping", None), **extra)


class Gemma3Attention(LlamaAttention):
    def __init__(self, cfg: Gemma3ArchConfig, layer_idx: int) -> None:
        super().__init__(cfg)
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.sliding_window = cfg.sliding_windows[layer_idx]


class Gemma3MLP(LlamaMLP):
    def forward(self, x: torch.Tensor, lora_index: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return all_reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up))


class Gemma3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: Gemma3ArchConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def make_attention(self, cfg: Gemma3ArchConfig, layer_idx: int) -> nn.Module:
        return Gemma3Attention(cfg, layer_idx)

    def make_mlp(self, cfg: Gemma3ArchConfig, layer_idx: int) -> nn.Module:
        return Gemma3MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        region = _local_layer if self.self_attn.sliding_window is not None else _global_layer
        return region(self, x, cos, sin, kv_cache[0], kv_cache[1], *meta.fields())


def _layer_body(layer: Gemma3DecoderLayer, x, cos, sin, k_cache, v_cache, *meta_fields) -> torch.Tensor:
    meta = AttentionMetadata(*meta_fields)
    attn = layer.self_attn(layer.input_layernorm(x), cos, sin, (k_cache, v_cache), meta)
    x = x + layer.post_attention_layernorm(attn)
    return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))


@layer_region
def _local_layer(layer: Gemma3DecoderLayer, x, cos, sin, k_cache, v_cache, *meta_fields) -> torch.Tensor:
    # Local and global layers differ in a constant (the window): one nested compile region each.
    return _layer_body(layer, x, cos, sin, k_cache, v_cache, *meta_fields)


@layer_region
def _global_layer(layer: Gemma3DecoderLayer, x, cos, sin, k_cache, v_cache, *meta_fields) -> torch.Tensor:
    return _layer_body(layer, x, cos, sin, k_cache, v_cache, *meta_fields)


class Gemma3Model(nn.Module):
    def __init__(self, cfg: Gemma3ArchConfig, hf_config, layer_cls: type[Gemma3DecoderLayer]) -> None:
        super().__init__()
        self.hidden_size = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([layer_cls(cfg, i) for i in range(cfg.num_layers)])
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        n = cfg.max_position_embeddings
        self.rotary_local = RotaryEmbedding(hf_config, n, "sliding_attention")
        self.rotary_global = RotaryEmbedding(hf_config, n, "full_attention")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype.
        return x * float(torch.tensor(self.hidden_size**0.5).to(x.dtype))

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None, aux_layers: tuple[int, ...] = (),
                lora_index=None):
        if aux_layers or lora_index is not None:
            raise ValueError("Gemma3 does not serve as a speculative-decoding target with taps or with LoRA adapters")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        local = self.rotary_local(positions, x.dtype)
        glob = self.rotary_global(positions, x.dtype)
        metas = meta if isinstance(meta, (list, tuple)) else [meta] * len(self.layers)
        for layer, kv_cache, m in zip(self.layers, kv_caches, metas):
            cos, sin = local if layer.self_attn.sliding_window is not None else glob
            x = layer(x, cos, sin, kv_cache, m)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer
    arch_cls = Gemma3ArchConfig
    takes_lora = False  # model/layers/lora.py refuses enable_lora
    model_cls = Gemma3Model

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
