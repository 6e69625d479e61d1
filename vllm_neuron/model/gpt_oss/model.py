"""gpt-oss: attention with sinks, alternating sliding-window / full layers, MoE with a clamped SwiGLU.

* Attention: q/k/v/o with biases, one learned sink logit per head (it joins the softmax and is
  dropped), YaRN RoPE (transformers' initialiser, model/layers/rotary.py); `sliding_attention` layers
  see the last `sliding_window` positions. Both run in the CPU kernel and on the torch path; the
  sliding layers form their own KV cache group (kv_cache_groups.py), which frees out-of-window blocks.
* MoE: router with bias, top-k then softmax over the k; experts with biases, gate/up interleaved in
  the stacked weight and the activation (up + 1) * gate * sigmoid(alpha * gate) with gate clamped
  above and up clamped both ways at `swiglu_limit`.
* Tensor / expert parallelism: Llama's Megatron split (q/k/v biases split with their rows, the o_proj
  bias added once), the sinks split with the heads; the experts split like Qwen3-MoE's
  (layers/expert_parallel.py: ep_degree groups of experts, each expert's interleaved gate/up rows and its
  down columns split inside a group, its down bias on the group's first rank); the router replicated.
* MXFP4 checkpoints are dequantized at load; `neuron_config.quantization: "mxfp4"` keeps the experts
  packed and dequantizes the experts a step uses inside the graph (model/layers/moe.py).
"""
from __future__ import annotations

import re

import torch
from torch import nn

from vllm_neuron.model.base import Target, load_named_weights
from vllm_neuron.model.gpt_oss.config import GptOssArchConfig
from vllm_neuron.model.gpt_oss.weights import expert_tensors
from vllm_neuron.model.layer_region import layer_region
from vllm_neuron.model.layers.attention import AttentionMetadata
from vllm_neuron.model.layers.expert_parallel import ExpertSplit
from vllm_neuron.model.layers.linear import Linear
from vllm_neuron.model.layers.moe import StackedExperts, topk_softmax
from vllm_neuron.model.layers.mxfp4 import GROUP
from vllm_neuron.model.layers.parallel import mark_split, tp_world
from vllm_neuron.model.llama.model import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, _decoder_layer,
                                           decoder_layer_body)


class GptOssAttention(LlamaAttention):
    def __init__(self, cfg: GptOssArchConfig, layer_idx: int) -> None:
        super().__init__(cfg)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))  # this rank's heads'
        if tp_world() > 1:
            mark_split(self.sinks)
        self.sliding_window = cfg.sliding_windows[layer_idx]


def clamped_swiglu(alpha: float, limit: float):
    def act(h: torch.Tensor) -> torch.Tensor:
        gate = h[..., ::2].clamp(max=limit)
        up = h[..., 1::2].clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))

    return act


class GptOssMoE(nn.Module):
    def __init__(self, cfg: GptOssArchConfig, mxfp4: bool) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = Linear(cfg.hidden_size, cfg.num_experts, bias=True)
        self.split = ExpertSplit.of(cfg.num_experts, cfg.intermediate_size, "intermediate_size")
        if mxfp4 and self.split.inter_ranks > 1 and self.split.local_intermediate % GROUP:
            raise ValueError(f"neuron_config.quantization='mxfp4' keeps gpt-oss's experts in blocks of {GROUP}, but "
                             f"tensor_parallel_size / ep_degree = {self.split.inter_ranks} leaves each rank "
                             f"{self.split.local_intermediate} of an expert's intermediate size (intermediate_size "
                             f"{cfg.intermediate_size}); use an ep_degree that keeps whole blocks")
        self.experts = StackedExperts(self.split.local_experts, cfg.hidden_size, self.split.local_intermediate,
                                      bias=True, activation=clamped_swiglu(cfg.swiglu_alpha, cfg.swiglu_limit),
                                      mxfp4=mxfp4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_softmax(self.router(x), self.top_k)
        return self.split.run(self.experts, x, weights, ids)


class GptOssDecoderLayer(LlamaDecoderLayer):
    mxfp4 = False

    def make_attention(self, cfg: GptOssArchConfig, layer_idx: int) -> nn.Module:
        return GptOssAttention(cfg, layer_idx)

    def make_mlp(self, cfg: GptOssArchConfig, layer_idx: int) -> nn.Module:
        return GptOssMoE(cfg, self.mxfp4)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        region = _sliding_decoder_layer if self.self_attn.sliding_window else _decoder_layer
        return region(self, x, cos, sin, kv_cache[0], kv_cache[1], *meta.fields())


class GptOssMXFP4DecoderLayer(GptOssDecoderLayer):
    mxfp4 = True


@layer_region
def _sliding_decoder_layer(layer: GptOssDecoderLayer, x, cos, sin, k_cache, v_cache, *meta_fields) -> torch.Tensor:
    # Sliding and full layers differ in a constant (the window): one nested region each.
    return decoder_layer_body(layer, x, cos, sin, k_cache, v_cache, *meta_fields)


class GptOssForCausalLM(LlamaForCausalLM):
    is_moe = True
    attention_sinks = True
    quantizations = ("mxfp4",)

    @classmethod
    def arch_config(cls, hf_config) -> GptOssArchConfig:
        return GptOssArchConfig.from_hf(hf_config)

    def __init__(self, hf_config, quantization: str | None = None) -> None:
        self.mxfp4 = quantization == "mxfp4"
        self.layer_cls = GptOssMXFP4DecoderLayer if self.mxfp4 else GptOssDecoderLayer
        super().__init__(hf_config, quantization)

    def load_weights(self, weights) -> int:
        dtype = self.model.embed_tokens.weight.dtype
        return load_named_weights(self, expert_tensors(weights, packed=self.mxfp4, dtype=dtype))

    def checkpoint_target(self, name: str) -> Target | None:
        m = _EXPERT_TENSOR.match(name)
        if m is None or tp_world() == 1:
            return super().checkpoint_target(name)
        split: ExpertSplit = self.get_submodule(m.group(1)).split
        return name, None, lambda t: _expert_piece(split, t, m.group(2), m.group(3))


# Stacked expert tensors as expert_tensors() yields them ([E, out, in] layout, MXFP4 blocks / scales
# [E, out, in / 32, 16] / [E, out, in / 32]).
_EXPERT_TENSOR = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)(|_bias|_blocks|_scales)$")


def _expert_piece(split: ExpertSplit, t: torch.Tensor, proj: str, suffix: str) -> torch.Tensor:
    """This rank's part of a stacked expert tensor: its experts; gate_up's rows of its intermediate piece
    (gate and up interleaved: two rows per index), down's columns of it (in MXFP4 blocks of 32)."""
    if proj == "down_proj":
        if suffix == "_bias":
            return split.output_bias(t)
        return split.rows(split.experts(t), 2, group=GROUP if suffix in ("_blocks", "_scales") else 1)
    return split.rows(split.experts(t), 1, per_index=2)
