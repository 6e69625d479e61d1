"""Expert parallelism for stacked experts (model/layers/moe.py), shared by the MoE families.

The experts are split in ep_degree groups of consecutive experts (parallel_state.ParallelInfo), and
each expert's intermediate size is split again over the world / ep_degree ranks of its group. The
router stays replicated and every rank sees every token (the attention output is all-reduced), so
dispatch is local: a rank keeps the (token, expert) pairs of its own experts (the others get weight 0)
and the combine is one all-reduce of the partial outputs. An expert's output bias (down_proj_bias) is
added once per expert: the first rank of its group holds it, the others hold zeros.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.model.layers.moe import StackedExperts
from vllm_neuron.model.layers.parallel import all_reduce


@dataclass(frozen=True)
class ExpertSplit:
    """This rank's experts [expert_start, + local_experts) and its piece `inter_rank` of `inter_ranks`
    of each one's intermediate size (local_intermediate of it)."""

    world: int
    num_experts: int
    local_experts: int
    expert_start: int
    local_intermediate: int
    inter_rank: int
    inter_ranks: int = 1

    @classmethod
    def of(cls, num_experts: int, intermediate_size: int, what: str = "moe_intermediate_size") -> "ExpertSplit":
        """`what`: the config field holding the experts' intermediate size (named in the error)."""
        info = ps.info()
        if num_experts % info.ep_degree:
            raise ValueError(f"ep_degree={info.ep_degree} must divide the number of experts ({num_experts})")
        local = num_experts // info.ep_degree
        inter_rank, inter_size = info.expert_tp
        if intermediate_size % inter_size:
            raise ValueError(f"tensor_parallel_size / ep_degree = {inter_size} must divide {what} "
                             f"({intermediate_size})")
        return cls(info.world, num_experts, local, info.ep_rank * local, intermediate_size // inter_size,
                   inter_rank, inter_size)

    def experts(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's experts of a stacked [E, ...] checkpoint tensor."""
        return t.narrow(0, self.expert_start, self.local_experts)

    def rows(self, t: torch.Tensor, dim: int, per_index: int = 1, group: int = 1) -> torch.Tensor:
        """This rank's piece of an expert's intermediate dimension `dim`, which holds `per_index` entries per
        intermediate index (2: gate and up interleaved) packed `group` to an entry (32: MXFP4 blocks)."""
        n = self.local_intermediate * per_index // group
        return t.narrow(dim, self.inter_rank * n, n)

    def output_bias(self, t: torch.Tensor) -> torch.Tensor:
        """A stacked [E, H] down_proj bias: this rank's experts, zeros unless it is the first of its group
        (the all-reduce adds the group's partial outputs, so the bias must enter once)."""
        t = self.experts(t)
        return t if self.inter_rank == 0 else torch.zeros_like(t)

    def run(self, experts: StackedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The MoE output for the router's choice (weights, ids [N, k] over all experts): local dispatch,
        all-reduce combine."""
        if self.world == 1:
            return experts(x, weights, ids)
        if self.local_experts < self.num_experts:
            local = ids - self.expert_start
            mine = (local >= 0) & (local < self.local_experts)
            weights, ids = weights * mine.to(weights.dtype), local.clamp(0, self.local_experts - 1)
        return all_reduce(experts(x, weights, ids))
