"""Who this process is in the tensor- and pipeline-parallel grid, and the groups themselves (torch.distributed).

One process per rank, gloo on CPU. With pipeline parallelism (distributed/pipeline.py) the world is
pp x tp ranks and each stage's ranks form a tensor-parallel group of their own: `ParallelInfo.rank` /
`world` stay the rank inside that group (what the model's splits read), `pp_rank` / `pp_size` say the
stage, and the hand-offs between stages travel on `pipe_group`. The model's collectives (all-reduce after
row-parallel layers, all-gather of the vocab-parallel logits) run on `model_group` (the stage's group),
whose operations time out after `timeout_s` (VLLM_NEURON_DIST_TIMEOUT_S), like the pipe group's: a rank
that hangs fails its peers' step. Step inputs travel on `control_group`, with no practical timeout,
because a follower waits there for as long as the engine is idle. A rank that dies closes its
connections, which fails its peers' pending operations at once. The world group itself only serves the
rendezvous, which waits up to JOIN_TIMEOUT for nodes that start late.

The rules on how heads and experts are split are pure functions here, so that the model, the KV
allocator and the tests agree on them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch

from vllm_neuron.distributed.pipeline import RankPlace, Stage, rank_place, stage_group_ranks, stage_layers

CONTROL_TIMEOUT = timedelta(days=365)
JOIN_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class ParallelInfo:
    """This process's place: rank / world of the TP group and the EP degree (experts split in
    `ep_degree` groups; each expert's intermediate size split again by world // ep_degree)."""

    rank: int = 0
    world: int = 1
    ep_degree: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    pp_micro_batches: int = 1  # a decode step's pieces between stages (model/pipeline_stage.py)

    @property
    def global_rank(self) -> int:
        return self.pp_rank * self.world + self.rank

    def place(self) -> RankPlace:
        return rank_place(self.global_rank, self.world, self.pp_size)

    def stage(self, num_layers: int) -> Stage:
        """This rank's pipeline stage of a model with `num_layers` decoder layers (all of them with one stage)."""
        return stage_layers(num_layers, self.pp_size, self.pp_rank)

    @property
    def ep_rank(self) -> int:
        return self.rank // (self.world // self.ep_degree)

    @property
    def expert_tp(self) -> tuple[int, int]:
        """(rank, size) of this process inside its expert group: how an expert's intermediate is split."""
        size = self.world // self.ep_degree
        return self.rank % size, size


_info = ParallelInfo()
_control = None
_model = None
_model_timeout = None
_pipe = None


def info() -> ParallelInfo:
    return _info


def set_info(value: ParallelInfo) -> None:
    """Sets the parallel place the model is built for (tests build shards without a group)."""
    global _info
    _info = value


def init(rank: int, world: int, master_addr: str, master_port: int, *, device_type: str, ep_degree: int,
         timeout_s: float, pp_size: int = 1) -> None:
    """Joins the process group (rank 0 hosts the TCP store) and records this rank's place. `world` counts
    every rank (tp x pp); each stage's model collectives run on a group of its own, and the activations
    between stages on `pipe_group` (whole world, the model group's timeout)."""
    import torch.distributed as dist

    global _control, _model, _model_timeout, _pipe
    if device_type != "cpu":
        raise ValueError(f"tensor parallelism runs on CPU (gloo) only, not on {device_type} (NCCL with one GPU "
                         "per rank is not built)")
    dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world, timeout=JOIN_TIMEOUT)
    _control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    tp_size = world // pp_size
    place = rank_place(rank, tp_size, pp_size)
    _model_timeout = timedelta(seconds=timeout_s)
    # Every rank creates every stage's group, in the same order (new_group is collective over the world).
    for ranks in stage_group_ranks(tp_size, pp_size):
        group = dist.new_group(ranks, backend="gloo", timeout=_model_timeout)
        if rank in ranks:
            _model = group
    _pipe = dist.new_group(backend="gloo", timeout=_model_timeout) if pp_size > 1 else None
    set_info(ParallelInfo(place.tp_rank, tp_size, ep_degree, place.pp_rank, pp_size))


def control_group():
    return _control


def new_subgroups(rank_lists: list[list[int]]):
    """The group of this rank among `rank_lists` (a partition of the world), with the model group's
    timeout, or None with one process. Every rank must call this with the same lists in the same order
    (torch.distributed.new_group's rule): the runner's set-up is replayed on every rank, so it is."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks, backend="gloo", timeout=_model_timeout)
        if _info.global_rank in ranks:  # (the lists hold world ranks; rank is the one inside a pipeline stage)
            mine = group
    return mine


def model_group():
    return _model


def pipe_group():
    """The group the activations and logits travel on between stages (None without pipeline parallelism)."""
    return _pipe


def shutdown() -> None:
    import torch.distributed as dist

    global _control, _model, _pipe
    if dist.is_initialized():
        dist.destroy_process_group()
    _control = _model = _pipe = None
    set_info(ParallelInfo())


# -- splitting rules (pure) ----------------------------------------------------------------------
def check_tp_divides(what: str, count: int, world: int) -> None:
    if count % world:
        raise ValueError(f"tensor_parallel_size={world} must divide {what} ({count})")


def local_kv_heads(num_kv_heads: int, world: int) -> int:
    """KV heads per rank. world <= heads: heads / world each (world must divide heads). world > heads:
    one head per rank, each head replicated on world / heads consecutive ranks (heads must divide
    world), so that a rank's query heads always find their KV head locally."""
    if world <= num_kv_heads:
        check_tp_divides("the number of KV heads", num_kv_heads, world)
        return num_kv_heads // world
    if world % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={world} is larger than the number of KV heads ({num_kv_heads}) "
                         f"and not a multiple of it: each KV head must be replicated on the same number of ranks")
    return 1


def piece_index(full: int, local: int, rank: int, world: int) -> int:
    """Which `local`-sized piece of a `full`-sized dimension rank `rank` holds: its own when the dimension
    is split world ways, rank * pieces // world when there are fewer pieces than ranks (replicated KV heads)."""
    pieces = full // local
    return rank * pieces // world


def threads_per_rank(local_ranks: int, cores: int | None = None) -> int:
    """CPU threads of each rank: this node's cores split between its ranks (at least one each)."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, local_ranks))


def set_rank_threads(local_ranks: int) -> int:
    n = threads_per_rank(local_ranks)
    torch.set_num_threads(n)
    return n
