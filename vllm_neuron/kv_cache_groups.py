"""KV cache groups: which layers share a block table (pure; used by the scheduler and the runner).

A model whose layers all attend the same way has one group: every layer, one block table per request.
A model that mixes full-attention and sliding-window layers (gpt-oss) gets one kind of group per
window: a sliding-window group can give back the blocks whose tokens all left its window, which a
full-attention group never can, so the two need block tables of their own.

All groups have the same number of layers (`group_size`, the gcd of the per-window layer counts) and
share one block pool: the runner allocates `group_size` K/V tensor pairs of `num_blocks` blocks, and
layer i reads and writes pair `layer_slot[i]` through its group's block table. A block id therefore
belongs to exactly one group at a time, and one block costs `group_size` layers of K/V, not
`num_layers` (vLLM's hybrid KV cache manager works the same way).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    layers: tuple[int, ...]
    sliding_window: int | None = None  # tokens a query sees (itself included); None: full attention


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def group_size(self) -> int:
        """Layers per group = K/V tensor pairs the runner allocates."""
        return len(self.groups[0].layers)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def layer_group(self) -> tuple[int, ...]:
        """Per layer: the index of its group."""
        out = [0] * self.num_layers
        for gi, g in enumerate(self.groups):
            for layer in g.layers:
                out[layer] = gi
        return tuple(out)

    def layer_slot(self) -> tuple[int, ...]:
        """Per layer: the K/V tensor pair it uses (its index inside its group)."""
        out = [0] * self.num_layers
        for g in self.groups:
            for j, layer in enumerate(g.layers):
                out[layer] = j
        return tuple(out)

    def blocks_per_request(self, max_model_len: int, block_size: int, max_chunk_tokens: int) -> int:
        """The most blocks one request of max_model_len tokens can hold at once, all groups together:
        a full group holds every block; a sliding group the window's history plus one scheduled chunk."""
        full = -(-max_model_len // block_size)
        total = 0
        for g in self.groups:
            if g.sliding_window is None:
                total += full
            else:
                total += min(full, -(-(g.sliding_window - 1 + max_chunk_tokens) // block_size) + 1)
        return total

    def describe(self) -> str:
        if self.num_groups == 1:
            return f"KV cache groups: 1 ({self.group_size} layers, one block table per request)"
        kinds = ", ".join(f"{len(g.layers)} layers {g.layers[0]}.. "
                          + ("full attention" if g.sliding_window is None else f"sliding window {g.sliding_window}")
                          for g in self.groups)
        return (f"KV cache groups: {self.num_groups} of {self.group_size} layers ({kinds}); sliding-window groups "
                f"free the blocks that leave their window; one block holds {self.group_size} layers' K/V")


def plan_kv_cache_layout(sliding_windows: Sequence[int | None]) -> KVCacheLayout:
    """Groups of equal size from per-layer windows: full-attention groups first, then one run of groups per
    window size, each in layer order."""
    if not sliding_windows:
        raise ValueError("a model needs at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(sliding_windows):
        if w is not None and w <= 0:
            raise ValueError(f"layer {i}: sliding window must be positive, got {w}")
        kinds.setdefault(w, []).append(i)
    if len(kinds) == 1:
        return KVCacheLayout((KVCacheGroup(tuple(range(len(sliding_windows))), sliding_windows[0]),))
    size = math.gcd(*(len(v) for v in kinds.values()))
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    groups = tuple(KVCacheGroup(tuple(kinds[w][i:i + size]), w) for w in order for i in range(0, len(kinds[w]), size))
    return KVCacheLayout(groups)


def single_group_layout(num_layers: int) -> KVCacheLayout:
    """Every layer in one group (a runner path without per-group block tables: nothing is freed early)."""
    return KVCacheLayout((KVCacheGroup(tuple(range(num_layers))),))


def first_needed_block(num_computed_tokens: int, window: int, block_size: int) -> int:
    """Index of the first block a sliding-window group still needs once `num_computed_tokens` are in the
    cache: the next query (at that position) sees positions from num_computed - window + 1 on."""
    return max(0, num_computed_tokens - window + 1) // block_size
