"""Host-side inputs of the vision tower for a set of images / videos (pure, CPU): position-embedding
interpolation taps, 2D rotary positions and attention segments, packed into blocks and padded to a
patch bucket.

The index math is transformers' own (`transformers.vision_utils`), so a mismatch with the reference
cannot creep in here; this module only packs the results into fixed shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

from vllm_neuron.model.qwen3_vl.block_packing import pack_ffd
from vllm_neuron.model.qwen3_vl.config import VisionArchConfig


@dataclass
class VisionInputs:
    pixels: torch.Tensor  # [P, patch_dim], P = blocks x block_size
    interp_idx: torch.Tensor  # [P, 4] long
    interp_w: torch.Tensor  # [P, 4] float32
    rot_pos: torch.Tensor  # [P, 2] long
    segment: torch.Tensor  # [blocks, block_size] long: one id per image or video frame, -1 for padding
    token_rows: torch.Tensor  # [real patches / merge_unit]: the output row of each merged token, in item order
    patch_rows: torch.Tensor  # [real patches]: the packed row of each patch, in item order
    num_patches: int  # real patches (the rest is padding)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.pixels, self.interp_idx, self.interp_w, self.rot_pos, self.segment


def vision_inputs(cfg: VisionArchConfig, pixels: list[torch.Tensor], grids: list[tuple[int, int, int]],
                  num_patches: int | None = None, block_size: int | None = None) -> VisionInputs:
    """Inputs for items with `pixels[i]` [t*h*w, patch_dim] and patch grid `grids[i]` (t, h, w), padded to
    `num_patches` rows (default: no padding). With `block_size`, images and frames are packed
    first-fit-decreasing into num_patches / block_size blocks; without, all of them share one block."""
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    real = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    total = real if num_patches is None else num_patches
    block = total if block_size is None else block_size
    if total < real or total % block or block % cfg.merge_unit:
        raise ValueError(f"{total} patches in blocks of {block} cannot hold {real} (multiples of {cfg.merge_unit})")
    side = int(cfg.num_position_embeddings ** 0.5)
    idx, w = get_vision_interpolation_indices_and_weights(grid, num_grid_per_side=side, mode="bilinear",
                                                          align_corners=True, spatial_merge_size=cfg.spatial_merge_size)
    rot = get_vision_position_ids(grid, cfg.spatial_merge_size)
    # Each frame attends only within itself (transformers' cu_seqlens: h*w patches per frame).
    sizes = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).tolist()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    packing = pack_ffd(sizes, block) if block_size is not None else [list(range(len(sizes)))]
    if len(packing) * block > total:
        raise ValueError(f"{len(sizes)} images / frames need {len(packing)} blocks of {block} patches; the bucket "
                         f"has {total // block}")
    dest = torch.empty(real, dtype=torch.long)  # packed row of each patch
    seg = torch.full((total,), -1, dtype=torch.long)
    for b, members in enumerate(packing):
        row = b * block
        for s in members:
            dest[starts[s]:starts[s] + sizes[s]] = torch.arange(row, row + sizes[s])
            seg[row:row + sizes[s]] = s
            row += sizes[s]
    px = torch.cat(pixels).reshape(real, cfg.patch_dim).float() if pixels else torch.zeros(0, cfg.patch_dim)

    def packed(src: torch.Tensor) -> torch.Tensor:
        out = src.new_zeros((total,) + tuple(src.shape[1:]))
        out[dest] = src
        return out

    return VisionInputs(pixels=packed(px), interp_idx=packed(idx), interp_w=packed(w.float()), rot_pos=packed(rot),
                        segment=seg.reshape(-1, block), token_rows=dest[::cfg.merge_unit] // cfg.merge_unit,
                        patch_rows=dest, num_patches=real)
