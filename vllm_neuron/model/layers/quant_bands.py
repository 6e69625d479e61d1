"""The band layout of the int8 / int4 decode kernels' weights (kernels/linear_quant.cpp).

A decode step streams every weight once, and the bytes arrive at full speed only as one sequential
stream per thread. The kernels compute BAND output rows at a time, so the rows of each band are stored
interleaved, one chunk of each in turn: a [N, C] tensor becomes, band by band, [C / chunk][rows][chunk]
(the last band holds the N % BAND rows left). The tensor keeps its [N, C] shape; only the order of its
elements changes, and `from_bands` gives back the row-major matrix.
"""
from __future__ import annotations

import torch

BAND = 4


def _check(t: torch.Tensor, chunk: int) -> None:
    if t.dim() != 2 or t.shape[1] % chunk:
        raise ValueError(f"band layout needs a [N, C] tensor with C divisible by {chunk}, got {list(t.shape)}")


def to_bands(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """Row-major [N, C] -> band layout (same shape, contiguous)."""
    _check(t, chunk)
    n, c = t.shape
    full = n // BAND * BAND
    head = t[:full].reshape(n // BAND, BAND, c // chunk, chunk).transpose(1, 2).reshape(full, c)
    tail = t[full:].reshape(n - full, c // chunk, chunk).transpose(0, 1).reshape(n - full, c)
    return torch.cat([head, tail]).contiguous()


def from_bands(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """Band layout -> row-major [N, C] (what `to_bands` was given)."""
    _check(t, chunk)
    n, c = t.shape
    full = n // BAND * BAND
    head = t[:full].reshape(n // BAND, c // chunk, BAND, chunk).transpose(1, 2).reshape(full, c)
    tail = t[full:].reshape(c // chunk, n - full, chunk).transpose(0, 1).reshape(n - full, c)
    return torch.cat([head, tail])
