"""Qwen3-MoE: Qwen3's attention; sparse layers route each token to top-k of E experts.

Router: softmax over all experts, top-k, renormalised when `norm_topk_prob`. How the experts are
computed per step (gathered for decode, dense for prefill) is model/layers/moe.py's. Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP.

Tensor / expert parallelism (parallel_state.ParallelInfo): the experts are split in ep_degree groups
of consecutive experts, and each expert's intermediate size is split again over the world / ep_degree
ranks of its group. The router is replicated and every rank sees every token (the attention output is
all-reduced), so dispatch is local: a rank keeps the (token, expert) pairs of its own experts (the
others get weight 0) and the combine is one all-reduce of the partial outputs.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.model.base import Target
from vllm_neuron.model.layers.linear import Linear
from vllm_neuron.model.layers.moe import StackedExperts, softmax_topk
from vllm_neuron.model.layers.parallel import all_reduce
from vllm_neuron.model.llama.config import LlamaArchConfig
from vllm_neuron.model.llama.model import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from vllm_neuron.model.qwen3.model import check_no_sliding_window

# Real checkpoints store one tensor per expert; transformers 5 holds them stacked.
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class Qwen3MoeArchConfig(LlamaArchConfig):
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[bool, ...] = ()


class Qwen3MoeSparseBlock(nn.Module):
    def __init__(self, cfg: Qwen3MoeArchConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.top_k, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.split = ExpertSplit.of(cfg)
        self.experts = StackedExperts(self.split.local_experts, cfg.hidden_size, self.split.local_intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x), self.top_k, self.norm_topk_prob)
        if self.split.world == 1:
            return self.experts(x, weights, ids)
        if self.split.local_experts < self.split.num_experts:
            local = ids - self.split.expert_start
            mine = (local >= 0) & (local < self.split.local_experts)
            weights, ids = weights * mine.to(weights.dtype), local.clamp(0, self.split.local_experts - 1)
        return all_reduce(self.experts(x, weights, ids))


@dataclass(frozen=True)
class ExpertSplit:
    """This rank's experts [expert_start, + local_experts) and its piece `inter_rank` of each one's
    intermediate size (local_intermediate of it)."""

    world: int
    num_experts: int
    local_experts: int
    expert_start: int
    local_intermediate: int
    inter_rank: int

    @classmethod
    def of(cls, cfg: Qwen3MoeArchConfig) -> "ExpertSplit":
        info = ps.info()
        if cfg.num_experts % info.ep_degree:
            raise ValueError(f"ep_degree={info.ep_degree} must divide the number of experts ({cfg.num_experts})")
        local = cfg.num_experts // info.ep_degree
        inter_rank, inter_size = info.expert_tp
        if cfg.moe_intermediate_size % inter_size:
            raise ValueError(f"tensor_parallel_size / ep_degree = {inter_size} must divide moe_intermediate_size "
                             f"({cfg.moe_intermediate_size})")
        return cls(info.world, cfg.num_experts, local, info.ep_rank * local,
                   cfg.moe_intermediate_size // inter_size, inter_rank)

    def rows(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's piece of an expert's intermediate dimension `dim`."""
        n = self.local_intermediate
        return t.narrow(dim, self.inter_rank * n, n)

    def stacked(self, t: torch.Tensor, proj: str) -> torch.Tensor:
        """This rank's part of a stacked [E, 2I, H] gate_up / [E, H, I] down checkpoint tensor."""
        t = t.narrow(0, self.expert_start, self.local_experts)
        if proj == "down_proj":
            return self.rows(t, 2)
        gate, up = t.chunk(2, dim=1)
        return torch.cat([self.rows(gate, 1), self.rows(up, 1)], dim=1)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, cfg: Qwen3MoeArchConfig, layer_idx: int) -> nn.Module:
        if cfg.sparse_layers[layer_idx]:
            return Qwen3MoeSparseBlock(cfg)
        return LlamaMLP(cfg.hidden_size, cfg.intermediate_size)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
    is_moe = True
    quantizations = ()  # int4 is untested on MoE layers: refused

    @classmethod
    def arch_config(cls, hf) -> Qwen3MoeArchConfig:
        check_no_sliding_window(hf, "Qwen3-MoE")
        only = set(getattr(hf, "mlp_only_layers", None) or [])
        step = getattr(hf, "decoder_sparse_step", 1) or 1
        sparse = tuple(i not in only and hf.num_experts > 0 and (i + 1) % step == 0
                       for i in range(hf.num_hidden_layers))
        return Qwen3MoeArchConfig.from_hf(
            hf, family="Qwen3-MoE", qk_norm=True, num_experts=hf.num_experts, top_k=hf.num_experts_per_tok,
            moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
            sparse_layers=sparse)

    def checkpoint_target(self, name: str) -> Target | None:
        m = _PER_EXPERT.match(name)
        if m is None:
            stacked = _STACKED.match(name)
            if stacked is not None and ps.info().world > 1:
                split = self.get_submodule(stacked.group(1)).split
                return name, None, lambda t: split.stacked(t, stacked.group(2))
            return super().checkpoint_target(name)
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        split: ExpertSplit = self.get_submodule(prefix.removesuffix(".experts")).split
        expert -= split.expert_start
        if not 0 <= expert < split.local_experts:
            return None  # another expert-parallel rank's expert
        i = split.local_intermediate
        if proj == "down_proj":
            return f"{prefix}.down_proj", (expert,), lambda t: split.rows(t, 1)
        rows = slice(0, i) if proj == "gate_proj" else slice(i, 2 * i)
        return f"{prefix}.gate_up_proj", (expert, rows), lambda t: split.rows(t, 0)
