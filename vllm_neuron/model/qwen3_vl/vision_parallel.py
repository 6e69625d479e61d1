"""The vision tower's own parallelism (encoder_neuron_config tp_size x dp_size), independent of the text
model's: the same ranks (the engine's tensor-parallel world) regrouped for the encoder.

Rank r is (dp_rank, tp_rank) = divmod(r, tp): TP groups are runs of consecutive ranks, DP groups take one
rank of each TP group. TP shards each vision block Megatron-style: the stacked qkv and the first MLP layer
split by heads / rows, `proj` and the second MLP layer by columns and summed over the TP group (their bias
added once, by TP rank 0); the patch embedding, position embedding and mergers stay whole (small). DP splits
a call's packed blocks: each DP rank runs its share of the blocks (blocks never attend across each other, so
nothing else needs the rest) and the merged tokens are gathered in block order. The collectives are torch's
traceable functional ones, so a compiled encoder graph holds them; with one rank in a group they are skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class VisionParallel:
    tp: int = 1
    dp: int = 1
    rank: int = 0  # in the engine's tensor-parallel world
    tp_group: Any = None  # process groups of this rank (None with one rank in them)
    dp_group: Any = None

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp


def group_ranks(tp: int, dp: int) -> tuple[list[list[int]], list[list[int]]]:
    """(TP groups, DP groups) of the tp * dp ranks, each a list of ranks."""
    tp_groups = [[d * tp + t for t in range(tp)] for d in range(dp)]
    dp_groups = [[d * tp + t for d in range(dp)] for t in range(tp)]
    return tp_groups, dp_groups


def tp_all_reduce(x: torch.Tensor, vp: VisionParallel) -> torch.Tensor:
    if vp.tp == 1:
        return x
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(x, "sum", vp.tp_group)


def dp_gather_rows(x: torch.Tensor, vp: VisionParallel) -> torch.Tensor:
    """[n, ...] on each DP rank -> [dp * n, ...], rank-major (block order)."""
    if vp.dp == 1:
        return x
    import torch.distributed._functional_collectives as fc

    return fc.all_gather_single(x.contiguous(), 0, vp.dp_group)


def dp_share(n: int, vp: VisionParallel) -> slice:
    """This DP rank's share of `n` blocks (the encoder buckets are whole multiples of dp blocks)."""
    if n % vp.dp:
        raise ValueError(f"{n} encoder blocks cannot be split over encoder dp_size={vp.dp}")
    local = n // vp.dp
    return slice(vp.dp_rank * local, (vp.dp_rank + 1) * local)


def shard_vision_tensor(name: str, tensor: torch.Tensor, vp: VisionParallel, num_heads: int) -> torch.Tensor:
    """This TP rank's piece of the checkpoint tensor `name` (model.visual.*), or the tensor whole."""
    if vp.tp == 1 or ".blocks." not in name:
        return tensor
    t, r = vp.tp, vp.tp_rank
    if ".attn.qkv." in name:  # [Q_all | K_all | V_all] stacked: each rank takes its heads of each
        parts = tensor.reshape(3, num_heads, -1, *tensor.shape[1:])
        local = num_heads // t
        return parts[:, r * local:(r + 1) * local].reshape(-1, *tensor.shape[1:])
    if ".mlp.linear_fc1." in name:
        return tensor.chunk(t, 0)[r]
    if name.endswith(("attn.proj.weight", "mlp.linear_fc2.weight")):
        return tensor.chunk(t, 1)[r]
    if name.endswith(("attn.proj.bias", "mlp.linear_fc2.bias")):
        return tensor if r == 0 else torch.zeros_like(tensor)
    return tensor
