"""gpt-oss: attention with sinks, alternating sliding-window / full layers, MoE with a clamped SwiGLU.

* Attention: q/k/v/o with biases, one learned sink logit per head (it joins the softmax and is
  dropped), YaRN RoPE (transformers' initialiser, model/layers/rotary.py); `sliding_attention` layers
  see the last `sliding_window` positions. Both run in the CPU kernel and on the torch path; the
  sliding layers form their own KV cache group (kv_cache_groups.py), which frees out-of-window blocks.
* MoE: router with bias, top-k then softmax over the k; experts with biases, gate/up interleaved in
  the stacked weight and the activation (up + 1) * gate * sigmoid(alpha * gate) with gate clamped
  above and up clamped both ways at `swiglu_limit`.
* MXFP4 checkpoints are dequantized at load; `neuron_config.quantization: "mxfp4"` keeps the experts
  packed and dequantizes the experts a step uses inside the graph (model/layers/moe.py).
"""
from __future__ import annotations

import torch
from torch import nn

from vllm_neuron.model.base import load_named_weights
from vllm_neuron.model.gpt_oss.config import GptOssArchConfig
from vllm_neuron.model.gpt_oss.weights import expert_tensors
from vllm_neuron.model.layers.attention import AttentionMetadata
from vllm_neuron.model.layers.linear import Linear
from vllm_neuron.model.layers.moe import StackedExperts, topk_softmax
from vllm_neuron.model.layers.parallel import tp_world
from vllm_neuron.model.llama.model import (LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, _decoder_layer,
                                           decoder_layer_body)


class GptOssAttention(LlamaAttention):
    def __init__(self, cfg: GptOssArchConfig, layer_idx: int) -> None:
        super().__init__(cfg)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))
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
        self.experts = StackedExperts(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, bias=True,
                                      activation=clamped_swiglu(cfg.swiglu_alpha, cfg.swiglu_limit), mxfp4=mxfp4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = topk_softmax(self.router(x), self.top_k)
        return self.experts(x, weights, ids)


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


@torch.compiler.nested_compile_region
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
        if tp_world() > 1:
            raise ValueError(f"tensor_parallel_size={tp_world()} is not supported yet for gpt-oss (sinks and biased "
                             "experts are not sharded); use tensor_parallel_size=1")
        self.mxfp4 = quantization == "mxfp4"
        self.layer_cls = GptOssMXFP4DecoderLayer if self.mxfp4 else GptOssDecoderLayer
        super().__init__(hf_config, quantization)

    def load_weights(self, weights) -> int:
        dtype = self.model.embed_tokens.weight.dtype
        return load_named_weights(self, expert_tensors(weights, packed=self.mxfp4, dtype=dtype))
