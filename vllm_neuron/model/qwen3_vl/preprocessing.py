"""Host-side inputs of the vision tower for a set of images / videos (pure, CPU): position-embedding
interpolation taps, 2D rotary positions and attention segments, padded to a patch bucket.

The index math is transformers' own (`transformers.vision_utils`), so a mismatch with the reference
cannot creep in here; this module only packs the results into fixed shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

from vllm_neuron.model.qwen3_vl.config import VisionArchConfig


@dataclass
class VisionInputs:
    pixels: torch.Tensor  # [P, patch_dim]
    interp_idx: torch.Tensor  # [P, 4] long
    interp_w: torch.Tensor  # [P, 4] float32
    rot_pos: torch.Tensor  # [P, 2] long
    segment: torch.Tensor  # [P] long: one id per image or video frame, -1 for padding
    num_patches: int  # real patches (the rest is padding)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.pixels, self.interp_idx, self.interp_w, self.rot_pos, self.segment


def vision_inputs(cfg: VisionArchConfig, pixels: list[torch.Tensor], grids: list[tuple[int, int, int]],
                  num_patches: int | None = None) -> VisionInputs:
    """Inputs for items with `pixels[i]` [t*h*w, patch_dim] and patch grid `grids[i]` (t, h, w), padded
    to `num_patches` rows (default: no padding)."""
    grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
    real = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    total = real if num_patches is None else num_patches
    if total < real or total % cfg.merge_unit:
        raise ValueError(f"{total} patches cannot hold {real} (a multiple of {cfg.merge_unit} is needed)")
    side = int(cfg.num_position_embeddings ** 0.5)
    idx, w = get_vision_interpolation_indices_and_weights(grid, num_grid_per_side=side, mode="bilinear",
                                                          align_corners=True, spatial_merge_size=cfg.spatial_merge_size)
    rot = get_vision_position_ids(grid, cfg.spatial_merge_size)
    # Each frame attends only within itself (transformers' cu_seqlens: h*w patches per frame).
    frames = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0])
    seg = torch.repeat_interleave(torch.arange(len(frames)), frames)
    pad = total - real
    px = torch.cat(pixels).reshape(real, cfg.patch_dim) if pixels else torch.zeros(0, cfg.patch_dim)
    return VisionInputs(
        pixels=torch.cat([px.float(), px.new_zeros(pad, cfg.patch_dim).float()]),
        interp_idx=torch.cat([idx, idx.new_zeros(pad, idx.shape[1])]),
        interp_w=torch.cat([w.float(), w.new_zeros(pad, w.shape[1]).float()]),
        rot_pos=torch.cat([rot, rot.new_zeros(pad, 2)]),
        segment=torch.cat([seg, torch.full((pad,), -1, dtype=torch.long)]),
        num_patches=real)
