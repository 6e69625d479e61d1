"""Qwen3-MoE: Qwen3's attention; sparse layers route each token to top-k of E experts.

Router: softmax over all experts, top-k, renormalised when `norm_topk_prob`. How the experts are
computed per step (gathered for decode, dense for prefill) is model/layers/moe.py's. Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP.

Tensor / expert parallelism: model/layers/expert_parallel.py's `ExpertSplit` (experts in ep_degree
groups, each expert's intermediate split inside its group; local dispatch, all-reduce combine).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.model.base import Target
from vllm_neuron.model.layers.expert_parallel import ExpertSplit
from vllm_neuron.model.layers.linear import Linear
from vllm_neuron.model.layers.moe import StackedExperts, softmax_topk
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
        self.split = ExpertSplit.of(cfg.num_experts, cfg.moe_intermediate_size)
        self.experts = StackedExperts(self.split.local_experts, cfg.hidden_size, self.split.local_intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x), self.top_k, self.norm_topk_prob)
        return self.split.run(self.experts, x, weights, ids)


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
                return name, None, lambda t: _stacked_piece(split, t, stacked.group(2))
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


def _stacked_piece(split: ExpertSplit, t: torch.Tensor, proj: str) -> torch.Tensor:
    """This rank's part of a stacked [E, 2I, H] gate_up (gate rows, then up rows) / [E, H, I] down tensor."""
    t = split.experts(t)
    if proj == "down_proj":
        return split.rows(t, 2)
    gate, up = t.chunk(2, dim=1)
    return torch.cat([split.rows(gate, 1), split.rows(up, 1)], dim=1)
