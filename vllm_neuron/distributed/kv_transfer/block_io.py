"""Whole KV blocks out of and into the paged pool, a slice of KV heads at a time.

A layer's cache is [slots, kv_heads, head_dim] with slot = block * block_size + offset (model/layers/attention.py);
a transfer moves, for every K/V tensor of the pool, the same list of blocks as one contiguous array
[blocks, block_size, heads, head_dim]: one frame per tensor. FP8 caches move as their stored bytes (both
instances dequantize with the checkpoint's scales).
"""
from __future__ import annotations

import torch

KVPairs = list  # [(K, V)] of [slots, kv_heads, head_dim]


def _blocks_view(t: torch.Tensor, block_size: int) -> torch.Tensor:
    usable = t.shape[0] - t.shape[0] % block_size
    return t[:usable].view(usable // block_size, block_size, *t.shape[1:])


def gather_blocks(kv: KVPairs, block_ids: list[int], block_size: int, head_start: int,
                  head_count: int) -> list[torch.Tensor]:
    """One contiguous [len(block_ids), block_size, head_count, head_dim] tensor per K and V of every pair, in
    pair order (K then V)."""
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv[0][0].device)
    out = []
    for pair in kv:
        for t in pair:
            out.append(_blocks_view(t, block_size)[idx, :, head_start:head_start + head_count].contiguous())
    return out


def scatter_blocks(kv: KVPairs, block_ids: list[int], block_size: int, head_start: int,
                   frames: list[torch.Tensor]) -> None:
    """Writes `frames` (gather_blocks' layout) into blocks `block_ids`, heads from `head_start` on."""
    if len(frames) != 2 * len(kv):
        raise ValueError(f"{len(frames)} frames for {len(kv)} K/V pairs")
    idx = torch.tensor(block_ids, dtype=torch.long, device=kv[0][0].device)
    for t, f in zip((t for pair in kv for t in pair), frames):
        view = _blocks_view(t, block_size)
        if f.shape[0] != len(block_ids) or f.shape[1] != block_size or f.shape[3:] != view.shape[3:] or \
                f.dtype != t.dtype or head_start + f.shape[2] > view.shape[2]:
            raise ValueError(f"a frame of shape {tuple(f.shape)} and {f.dtype} does not fit {len(block_ids)} blocks "
                             f"of {tuple(view.shape[1:])} {t.dtype} from head {head_start}")
        view[idx, :, head_start:head_start + f.shape[2]] = f.to(t.device)


def frame_bytes(frames: list[torch.Tensor]) -> int:
    return sum(f.numel() * f.element_size() for f in frames)
