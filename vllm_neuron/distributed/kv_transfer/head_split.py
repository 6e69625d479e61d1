"""Which KV heads each tensor-parallel rank holds, and where a reading rank finds its own on an instance of
another tensor-parallel size (pure; the split rules are parallel_state's)."""
from __future__ import annotations

from dataclasses import dataclass

from vllm_neuron.distributed.parallel_state import local_kv_heads, piece_index


def rank_heads(num_kv_heads: int, world: int, rank: int) -> range:
    """The global KV heads rank `rank` of a `world`-rank instance holds (replicated ones included)."""
    local = local_kv_heads(num_kv_heads, world)
    start = piece_index(num_kv_heads, local, rank, world) * local
    return range(start, start + local)


@dataclass(frozen=True)
class HeadSlice:
    """Heads [src_start, src_start + count) of source rank `src_rank`'s cache go to heads [dst_start, ...) of
    the reader's (both local indices)."""

    src_rank: int
    src_start: int
    dst_start: int
    count: int


def read_plan(num_kv_heads: int, src_world: int, dst_world: int, dst_rank: int) -> list[HeadSlice]:
    """How reader rank `dst_rank` (of `dst_world`) gathers its heads from an instance of `src_world` ranks:
    contiguous runs, each from the first source rank that holds them."""
    want = rank_heads(num_kv_heads, dst_world, dst_rank)
    held = [rank_heads(num_kv_heads, src_world, r) for r in range(src_world)]
    plan: list[HeadSlice] = []
    for i, head in enumerate(want):
        src = next(r for r, heads in enumerate(held) if head in heads)
        last = plan[-1] if plan else None
        if last is not None and last.src_rank == src and last.src_start + last.count == head - held[src].start \
                and last.dst_start + last.count == i:
            plan[-1] = HeadSlice(src, last.src_start, last.dst_start, last.count + 1)
        else:
            plan.append(HeadSlice(src, head - held[src].start, i, 1))
    return plan
