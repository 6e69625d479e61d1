"""Pipeline parallelism's arithmetic (pure): which layers a stage holds, where a global rank sits in the
pp x tp grid, which ranks a node runs, and which models and sizes a pipeline takes.

Ranks are numbered stage-major: global rank = pp_rank * tp + tp_rank, so a stage's tensor-parallel ranks are
consecutive and (with --nnodes dividing the world) a stage never straddles more nodes than it must; node k
runs ranks k * world / nnodes .. (k + 1) * world / nnodes - 1, rank 0 (stage 0's first rank, the engine core's
process) on node 0. Activations go from rank (s, t) to rank (s + 1, t): after a stage's last all-reduce every
tensor-parallel rank holds the whole hidden state, so each column of the grid is a pipeline of its own.
"""
from __future__ import annotations

from dataclasses import dataclass

# The decoder loops whose stages are built (model/llama/model.py: Qwen3 is Llama plus q/k norms). Other
# families override the model's forward (Gemma 3, Granite, ...) or hold per-layer state a stage split has not
# been written for (sliding-window KV groups, experts).
PIPELINE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class Stage:
    """One pipeline stage of a model with `num_layers` decoder layers: its layers [start, stop)."""

    pp_rank: int
    pp_size: int
    start: int
    stop: int

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.stop


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> Stage:
    """The layers of stage `pp_rank` of `pp_size`: contiguous, sizes differing by at most one, the earlier
    stages taking the extra layers (the last stage also runs the LM head, in SmolLM2-135M as many weights as
    eight of its layers; the first one's embedding is a lookup)."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline stage {pp_rank} of {pp_size} does not exist")
    check_layers(num_layers, pp_size)
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return Stage(pp_rank, pp_size, start, start + base + (1 if pp_rank < extra else 0))


def check_layers(num_layers: int, pp_size: int) -> None:
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} is larger than the model's number of decoder layers "
                         f"({num_layers}): every stage needs at least one layer; use at most {num_layers}")


def check_pipeline_model(pp_size: int, architectures: list[str] | None, num_layers: int) -> None:
    """Refuses a pipeline this model cannot be split into (before any rank starts)."""
    if pp_size == 1:
        return
    arch = (architectures or ["?"])[0]
    if arch not in PIPELINE_ARCHITECTURES:
        raise ValueError(f"pipeline_parallel_size={pp_size} is not supported yet by vllm-neuron for {arch}: stages "
                         f"are built for {', '.join(PIPELINE_ARCHITECTURES)}; use pipeline_parallel_size=1 "
                         "(--tensor-parallel-size splits the other models)")
    check_layers(num_layers, pp_size)


@dataclass(frozen=True)
class RankPlace:
    """Where a global rank sits: its stage and its rank inside the stage's tensor-parallel group."""

    rank: int
    pp_rank: int
    tp_rank: int
    tp_size: int
    pp_size: int

    @property
    def world(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def prev_rank(self) -> int | None:
        """The global rank this one receives activations from (None on the first stage)."""
        return None if self.pp_rank == 0 else self.rank - self.tp_size

    @property
    def next_rank(self) -> int | None:
        """The global rank this one sends activations to (None on the last stage)."""
        return None if self.pp_rank == self.pp_size - 1 else self.rank + self.tp_size

    @property
    def last_stage_rank(self) -> int:
        """The rank of the last stage in this rank's column (it computes the logits this rank samples from)."""
        return (self.pp_size - 1) * self.tp_size + self.tp_rank

    @property
    def column(self) -> list[int]:
        """The global ranks of every stage at this tp_rank, first stage first."""
        return [s * self.tp_size + self.tp_rank for s in range(self.pp_size)]


def rank_place(rank: int, tp_size: int, pp_size: int) -> RankPlace:
    world = tp_size * pp_size
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the world of {world} ranks (tensor {tp_size} x pipeline {pp_size})")
    return RankPlace(rank, rank // tp_size, rank % tp_size, tp_size, pp_size)


def stage_group_ranks(tp_size: int, pp_size: int) -> list[list[int]]:
    """Each stage's tensor-parallel group (its model collectives), in stage order."""
    return [list(range(s * tp_size, (s + 1) * tp_size)) for s in range(pp_size)]


def node_ranks(node_rank: int, world: int, nnodes: int) -> range:
    """The global ranks node `node_rank` of `nnodes` runs (node 0 holds rank 0, the engine core's)."""
    if nnodes < 1 or world % nnodes:
        raise ValueError(f"nnodes={nnodes} must divide the world of {world} ranks (tensor_parallel_size x "
                         "pipeline_parallel_size): each node runs the same number of ranks")
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank={node_rank} is outside 0..{nnodes - 1}")
    per_node = world // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def micro_batch_rows(rows: int, micro_batches: int) -> list[tuple[int, int]]:
    """[start, stop) of each micro-batch of a step's `rows` decode rows: `micro_batches` contiguous pieces, sizes
    differing by at most one (fewer pieces when there are fewer rows)."""
    m = max(1, min(micro_batches, rows))
    base, extra = divmod(rows, m)
    out, start = [], 0
    for j in range(m):
        stop = start + base + (1 if j < extra else 0)
        out.append((start, stop))
        start = stop
    return out

