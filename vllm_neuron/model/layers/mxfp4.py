"""MXFP4 (OCP microscaling FP4): groups of 32 E2M1 values sharing one power-of-two scale.

gpt-oss ships its expert weights this way: `<name>_blocks` [..., G, 16] uint8 (two 4-bit codes per
byte, low nibble first) and `<name>_scales` [..., G] uint8 (exponent + 127), for a [..., G * 32] weight.
Every FP4 value times a power of two is exact in bf16 and fp32, so dequantizing loses nothing.
"""
from __future__ import annotations

import torch

GROUP = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] in `dtype` (also inside a graph)."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: low nibble first
    values = lut[codes].reshape(*blocks.shape[:-1], GROUP)
    values = values * torch.exp2(scales.to(torch.float32) - 127.0)[..., None]
    return values.reshape(*blocks.shape[:-2], -1).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] (K a multiple of 32) -> (blocks [..., K/32, 16], scales [..., K/32]); round to nearest."""
    if w.shape[-1] % GROUP:
        raise ValueError(f"MXFP4 needs the last dimension to be a multiple of {GROUP}, got {tuple(w.shape)}")
    g = w.float().reshape(*w.shape[:-1], -1, GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    # The largest FP4 magnitude is 6 = 1.5 * 2^2: the scale brings the group's max to at most 6.
    exp = torch.ceil(torch.log2(torch.clamp(amax, min=2.0**-126) / 6.0)).clamp(-127, 127)
    scaled = g / torch.exp2(exp)
    lut = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs()[..., None] - lut).abs().argmin(dim=-1)
    codes = codes + 8 * (scaled < 0)
    codes = codes.to(torch.uint8).reshape(*g.shape[:-1], GROUP // 2, 2)
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks, (exp[..., 0] + 127).to(torch.uint8)
