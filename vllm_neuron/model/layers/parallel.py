"""Tensor-parallel building blocks: the collectives the model calls inside its graphs, the
vocab-parallel embedding and logits, and how a checkpoint tensor is cut to this rank's shard.

The collectives are torch's traceable functional collectives, so a compiled bucket graph holds them
(one graph per bucket on every rank, the same graph shape everywhere). With one rank they are
identities and the graphs are unchanged.

Megatron-style split of a decoder layer: q/k/v and gate/up are column-parallel (each rank holds its
heads / its slice of the intermediate size), o_proj and down_proj are row-parallel and end with an
all-reduce. A row-parallel layer's bias must enter the sum once: rank 0 holds it, the other ranks
load zeros (`mark_added_once`); column-parallel biases split with their rows. KV heads follow parallel_state.local_kv_heads (replicated when ranks outnumber them).
The embedding and the output layer are split over the vocabulary (padded to a multiple of the
ranks); logits are all-gathered, so every rank samples from the same full row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_neuron.distributed import parallel_state as ps


def tp_world() -> int:
    return ps.info().world


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel ranks (identity with one)."""
    if ps.info().world == 1:
        return x
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(x, "sum", ps.model_group())


def gather_last_dim(x: torch.Tensor, full: int) -> torch.Tensor:
    """[N, full / world] on each rank -> [N, full] on every rank (the padding beyond `full` dropped)."""
    world = ps.info().world
    if world == 1:
        return x
    import torch.distributed._functional_collectives as fc

    n, local = x.shape
    g = fc.all_gather_single(x.contiguous(), 0, ps.model_group())  # [world * N, local], rank-major
    return g.view(world, n, local).permute(1, 0, 2).reshape(n, world * local)[:, :full]


def split_size(total: int, what: str) -> int:
    """This rank's share of a dimension that the ranks must divide evenly."""
    world = ps.info().world
    ps.check_tp_divides(what, total, world)
    return total // world


def mark_split(*params: nn.Parameter) -> None:
    """The checkpoint tensors of these parameters are cut to this rank's shard at load (`shard_tensor`)."""
    for p in params:
        if p is not None:
            p.tp_split = True


def mark_added_once(*params: nn.Parameter) -> None:
    """Biases of row-parallel layers: every rank adds its own before the all-reduce, so only rank 0 loads
    the checkpoint's values and the others zeros (`rank_tensor`)."""
    if ps.info().rank == 0:
        return
    for p in params:
        if p is not None:
            p.tp_zero = True


def rank_tensor(param: nn.Parameter, tensor: torch.Tensor, dest_shape: tuple[int, ...]) -> torch.Tensor:
    """What this rank loads from a full checkpoint tensor into `param` (or its part of `dest_shape`): its
    piece (`mark_split`), zeros (`mark_added_once`), or the tensor itself."""
    if getattr(param, "tp_split", False):
        tensor = shard_tensor(tensor, dest_shape)
    if getattr(param, "tp_zero", False):
        tensor = torch.zeros_like(tensor)
    return tensor


def shard_tensor(tensor: torch.Tensor, dest_shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's piece of a full checkpoint tensor for a destination of `dest_shape` (one differing
    dimension): piece `rank` of `world`, or, when there are fewer pieces than ranks (replicated KV heads),
    piece rank * pieces // world. A dimension that the ranks do not divide (the vocabulary) is padded
    with zeros first."""
    diff = [d for d, (a, b) in enumerate(zip(tensor.shape, dest_shape)) if a != b]
    if len(diff) != 1 or tensor.dim() != len(dest_shape):
        return tensor  # the loader's shape check names the mismatch
    d = diff[0]
    full, local = tensor.shape[d], dest_shape[d]
    info = ps.info()
    if full % local:
        pad = [0, 0] * (tensor.dim() - 1 - d) + [0, local - full % local]
        tensor, full = F.pad(tensor, pad), full + local - full % local
    i = ps.piece_index(full, local, info.rank, info.world)
    return tensor.narrow(d, i * local, local)


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over this rank's rows of the vocabulary (ceil(V / world) each, the last padded); the
    other ranks' tokens look up zeros and the all-reduce fills them in."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        world, rank = ps.info().world, ps.info().rank
        self.local_vocab = -(-vocab_size // world)
        self.vocab_start = rank * self.local_vocab
        super().__init__(self.local_vocab, hidden_size)
        self.full_vocab = vocab_size
        if world > 1:
            mark_split(self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if ps.info().world == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.local_vocab)
        x = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        return all_reduce(x * inside.unsqueeze(-1).to(x.dtype))
