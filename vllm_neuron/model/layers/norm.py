"""RMSNorm with fp32 statistics (bf16 statistics visibly change logits)."""
from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        # Same rounding order as transformers, so fp32 and bf16 match the reference bit for bit.
        return self.weight * h.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores w centred on 0 and the norm scales by (1 + w), in fp32 before
    rounding back (transformers' rounding order, so fp32 and bf16 match it)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
