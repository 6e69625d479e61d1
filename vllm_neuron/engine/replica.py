"""Where an EngineCore replica runs: its data-parallel rank, threads and device (shared by the API server and
a `serve --headless` node; engine/core_proc.py starts the process).

Replicas on one host share its cores and memory: on CPU each gets cores / replicas threads (2 cores,
2 replicas -> 1 thread each) and the KV budget is split between them (worker/memory.py's
local_workers); on CUDA they take the visible GPUs round-robin, splitting the budget of a GPU they share.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_neuron.config.device import replicas_sharing_memory
from vllm_neuron.config.engine_config import EngineConfig


@dataclass(frozen=True)
class ReplicaPlacement:
    rank: int  # data-parallel rank (global across nodes)
    num_threads: int | None  # torch threads on CPU (None: torch's default, the single-replica case)
    cuda_index: int | None  # the GPU on CUDA hosts
    kv_budget_shared_by: int  # replicas sharing this replica's memory (host RAM, or one GPU): the resolved
    # EngineConfig.kv_budget_shared_by of this host's replicas


def engine_identity(rank: int) -> bytes:
    """The ZMQ identity of replica `rank` (its DEALER socket), as the head's ROUTER sees it."""
    return b"engine-%d" % rank


def rank_of_identity(identity: bytes) -> int | None:
    if identity.startswith(b"engine-"):
        try:
            return int(identity[len(b"engine-"):])
        except ValueError:
            return None
    return None


def plan_placements(ranks: range, *, on_cuda: bool, cuda_count: int, cpu_threads: int,
                    tensor_parallel_size: int = 1) -> list[ReplicaPlacement]:
    """The placements of this host's replicas `ranks` (pure). cpu_threads: the threads one engine would
    use alone (torch's default); each of n replicas x TP ranks gets an equal share, at least one."""
    n = len(ranks)
    if n == 0:  # a head that runs only the API server
        return []
    shared_by = replicas_sharing_memory(on_cuda, n, cuda_count)
    if on_cuda:
        return [ReplicaPlacement(r, None, i % cuda_count, shared_by) for i, r in enumerate(ranks)]
    threads = None if n == 1 else max(1, cpu_threads // (n * tensor_parallel_size))
    return [ReplicaPlacement(r, threads, None, shared_by) for r in ranks]


def host_placements(config: EngineConfig, ranks: range) -> list[ReplicaPlacement]:
    """plan_placements for this host, probed."""
    import torch

    on_cuda = config.device == "cuda"
    return plan_placements(ranks, on_cuda=on_cuda, cuda_count=torch.cuda.device_count() if on_cuda else 0,
                           cpu_threads=torch.get_num_threads(), tensor_parallel_size=config.tensor_parallel_size)


def apply_placement(placement: ReplicaPlacement) -> None:
    """In the replica's own process, before the model loads."""
    import torch

    if placement.num_threads is not None:
        torch.set_num_threads(placement.num_threads)  # the custom kernels read at::get_num_threads() too
    if placement.cuda_index is not None:
        torch.cuda.set_device(placement.cuda_index)
