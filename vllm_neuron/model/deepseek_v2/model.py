"""DeepSeek-V2 (DeepseekV2ForCausalLM: V2-Lite and V2): multi-head latent attention (MLA) with the compressed latent
as the KV cache, and mixture-of-experts layers with shared experts.

MLA caches one vector per token and layer: the normed latent c (kv_lora_rank) and the rotated key part k_pe
(qk_rope_head_dim), 576 values for V2-Lite instead of 2 x 16 heads x 192. Attention runs on the latent in its
absorbed form: each head's no-position query q_nope is mapped into latent space by that head's slice of
kv_b_proj (W_UK), so that q . k = [q_nope W_UK, q_pe] . [c, k_pe]; the values are the latent too, and each head's
output leaves latent space through its W_UV slice. To the paged attention that is multi-query attention with one
KV "head" of 576 dims whose values are its keys (the pool holds one tensor per layer: V is K), and whose output's
first kv_lora_rank dims are the latent output.

RoPE: transformers rotates interleaved pairs (2i, 2i + 1); the q_proj / q_b_proj rows of each head's rotary part
and kv_a_proj_with_mqa's k_pe rows are permuted at load to halves (i, i + R/2), which `apply_rotary` rotates (a
dot product of two vectors permuted alike is unchanged). YaRN's mscale enters the softmax scale as transformers
does.

MoE: softmax router over the routed experts, top-k ("greedy", or "group_limited_greedy": the best `topk_group`
groups of experts first), weights times routed_scaling_factor (not renormalised), plus the
shared experts' MLP on every token; the first `first_k_dense_replace` layers are dense.

Not supported yet (refused): tensor parallelism, int8/int4 weights, FP8 KV cache, LoRA, norm_topk_prob=True.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from vllm_neuron.model.base import ModelSpec, Target
from vllm_neuron.model.layers.attention import AttentionMetadata, paged_attention
from vllm_neuron.model.layers.linear import Linear
from vllm_neuron.model.layers.moe import StackedExperts
from vllm_neuron.model.layers.norm import RMSNorm
from vllm_neuron.model.layers.parallel import tp_world
from vllm_neuron.model.layers.rotary import apply_rotary
from vllm_neuron.model.llama.config import LlamaArchConfig
from vllm_neuron.model.llama.model import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class DeepseekV2ArchConfig(LlamaArchConfig):
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    softmax_scale: float = 1.0
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1


def _softmax_scale(hf) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale squared when the rope scaling sets mscale_all_dim."""
    import math

    scale = (hf.qk_nope_head_dim + hf.qk_rope_head_dim) ** -0.5
    params = getattr(hf, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class DeepseekV2MLA(nn.Module):
    def __init__(self, cfg: DeepseekV2ArchConfig) -> None:
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_heads
        self.num_heads, self.nope, self.rope = heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.latent, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, heads * qk, bias=False)
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * qk, bias=False)
        self.q_lora = cfg.q_lora_rank is not None
        self.kv_a_proj_with_mqa = Linear(h, self.latent + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.latent, cfg.rms_norm_eps)
        self.kv_b_proj = Linear(self.latent, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = Linear(heads * self.v_dim, h, bias=cfg.attention_bias)
        self.scale = cfg.softmax_scale

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x) if not self.q_lora else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(n, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        c = self.kv_a_layernorm(c)
        q_pe = apply_rotary(q_pe, cos, sin)
        k_pe = apply_rotary(k_pe.view(n, 1, self.rope), cos, sin)
        # W_UK [heads, nope, latent] and W_UV [heads, v, latent]: views of kv_b_proj's weight.
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.latent)
        q_lat = torch.einsum("thn,hnl->thl", q_nope, w[:, :self.nope].to(q.dtype))
        k = torch.cat([c.view(n, 1, self.latent), k_pe], dim=-1)  # what the cache holds
        out = paged_attention(torch.cat([q_lat, q_pe], dim=-1), k, k, kv_cache[0], kv_cache[1], meta, self.scale)
        out_lat = out.view(n, self.num_heads, self.latent + self.rope)[..., :self.latent]
        out = torch.einsum("thl,hvl->thv", out_lat, w[:, self.nope:].to(out.dtype))
        return self.o_proj(out.reshape(n, self.num_heads * self.v_dim))


class DeepseekV2MoE(nn.Module):
    def __init__(self, cfg: DeepseekV2ArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = StackedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = LlamaMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) \
            if cfg.n_shared_experts else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] in x's dtype, expert ids [N, k]): transformers' DeepseekV2TopkRouter, in float32."""
        cfg = self.cfg
        scores = torch.softmax(torch.nn.functional.linear(x.float(), self.gate.weight.float()), dim=-1)
        if cfg.topk_method == "group_limited_greedy":
            per_group = cfg.num_experts // cfg.n_group
            best = scores.view(-1, cfg.n_group, per_group).amax(dim=-1).topk(cfg.topk_group, dim=-1).indices
            keep = torch.zeros_like(scores[:, :cfg.n_group]).scatter_(1, best, 1.0)
            scores = scores * keep.repeat_interleave(per_group, dim=1)
        weights, ids = torch.topk(scores, cfg.top_k, dim=-1)
        return (weights * cfg.routed_scaling_factor).to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, *self.route(x))
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    def make_attention(self, cfg: DeepseekV2ArchConfig, layer_idx: int) -> nn.Module:
        return DeepseekV2MLA(cfg)

    def make_mlp(self, cfg: DeepseekV2ArchConfig, layer_idx: int) -> nn.Module:
        if layer_idx < cfg.first_k_dense_replace or not cfg.num_experts:
            return LlamaMLP(cfg.hidden_size, cfg.intermediate_size)
        return DeepseekV2MoE(cfg)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    layer_cls = DeepseekV2DecoderLayer
    is_moe = True
    takes_lora = False
    quantizations = ()  # int8 / int4 would quantize kv_b_proj, whose weight MLA reads as W_UK / W_UV

    @classmethod
    def arch_config(cls, hf) -> DeepseekV2ArchConfig:
        method = getattr(hf, "topk_method", "greedy") or "greedy"
        if method not in TOPK_METHODS:
            raise ValueError(f"DeepSeek-V2 topk_method={method!r} is not supported; supported: {list(TOPK_METHODS)}")
        if getattr(hf, "norm_topk_prob", False):
            raise ValueError("DeepSeek-V2 norm_topk_prob=True is not supported (transformers' DeepSeek-V2 router, "
                             "our reference, does not renormalise; no released V2 sets it)")
        experts = getattr(hf, "n_routed_experts", None) or 0
        if experts and not getattr(hf, "num_experts_per_tok", None):
            raise ValueError("DeepSeek-V2 config has n_routed_experts but no num_experts_per_tok")
        return DeepseekV2ArchConfig.from_hf(
            hf, family="DeepSeek-V2", q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
            qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
            softmax_scale=_softmax_scale(hf), num_experts=experts, top_k=getattr(hf, "num_experts_per_tok", 0) or 0,
            moe_intermediate_size=getattr(hf, "moe_intermediate_size", 0) or 0,
            n_shared_experts=getattr(hf, "n_shared_experts", 0) or 0,
            first_k_dense_replace=getattr(hf, "first_k_dense_replace", 0) or 0,
            routed_scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0) or 1.0),
            topk_method=method,
            n_group=getattr(hf, "n_group", None) or 1, topk_group=getattr(hf, "topk_group", None) or 1)

    @classmethod
    def spec(cls, hf_config) -> ModelSpec:
        a = cls.arch_config(hf_config)
        return ModelSpec(a.num_layers, 1, a.kv_lora_rank + a.qk_rope_head_dim, (None,) * a.num_layers, is_moe=True,
                         quantizations=cls.quantizations, values_are_keys=True)

    def __init__(self, hf_config, quantization: str | None = None) -> None:
        if tp_world() > 1:
            raise ValueError("DeepSeek-V2 with tensor_parallel_size > 1 is not supported yet (MLA's latent cache "
                             "is one head: it would be replicated on every rank); use tensor_parallel_size=1")
        super().__init__(hf_config, quantization)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        s = self.model_spec
        return s.num_layers, 1, s.head_dim

    def checkpoint_target(self, name: str) -> Target | None:
        rope = self.arch.qk_rope_head_dim
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            qk = self.arch.qk_nope_head_dim + rope
            return name, None, lambda t: _halves(t.view(-1, qk, *t.shape[1:]), self.arch.qk_nope_head_dim).flatten(0, 1)
        if name.endswith("self_attn.kv_a_proj_with_mqa.weight") or name.endswith("self_attn.kv_a_proj_with_mqa.bias"):
            return name, None, lambda t: _halves(t[None], self.arch.kv_lora_rank)[0]
        m = _PER_EXPERT.match(name)
        if m is not None:  # real checkpoints: one tensor per expert; transformers 5 holds them stacked
            prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            i = self.arch.moe_intermediate_size
            if proj == "down_proj":
                return f"{prefix}.down_proj", (expert,), None
            return f"{prefix}.gate_up_proj", (expert, slice(0, i) if proj == "gate_proj" else slice(i, 2 * i)), None
        return super().checkpoint_target(name)


def _halves(t: torch.Tensor, start: int) -> torch.Tensor:
    """Rows [start:] of each group (dim 1) reordered from interleaved pairs to halves: 0 2 4 .. 1 3 5 .."""
    rot = t[:, start:]
    return torch.cat([t[:, :start], rot[:, 0::2], rot[:, 1::2]], dim=1)
