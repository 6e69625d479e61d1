"""Weight-only int8 for CPU (`neuron_config.quantization: "int8"`): symmetric, one fp32 scale per output
channel (w = q * scale[n], q in -127..127).

Half of bf16's bytes per weight. Up to `kernel_rows` rows (cpu_caps.quant_kernel_rows) the project's kernel
(kernels/linear_quant.cpp) widens the weights in registers and reads each byte once, in the band order it streams fastest
(quant_bands.py, chunks of CHUNK weights); prefill-sized inputs multiply by the int8 weight put back in
row order and converted to the activation dtype (exact; one pass in the kernel library where it is built)
and scale the output columns, one ordinary matmul.
"""
from __future__ import annotations

import torch

from vllm_neuron.model.layers.kernels import ops
from vllm_neuron.model.layers.quant_bands import from_bands, to_bands

CHUNK = 16  # weights of one row per step of the kernel


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K] in band layout, scale float32 [N]) of a [N, K] weight."""
    n, k = weight.shape
    if k % 16:
        raise ValueError(f"int8 quantization needs in_features divisible by 16, got a [{n}, {k}] weight")
    w = weight.detach().float()
    scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return to_bands(q, CHUNK), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The row-major [N, K] weight in `dtype` of `quantize`'s output."""
    return (from_bands(q, CHUNK).float() * scale[:, None]).to(dtype)


def scaled_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale[:, None])^T for int8 or FP8 `q` with one scale per output row: q's values are exact in
    the compute dtype, and a per-row scale commutes with the matmul (one ordinary matmul, no dequantized copy)."""
    return (torch.nn.functional.linear(x, q.to(x.dtype)).float() * scale).to(x.dtype)


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           kernel_rows: int) -> torch.Tensor:
    """x @ W^T (+ bias): the kernel up to `kernel_rows` rows, its one-pass unpacking + matmul above; torch
    alone where kernel_rows is 0 (no kernel build)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= kernel_rows:
        y = ops.linear_int8(rows, q, scale)
    elif kernel_rows:
        y = scaled_linear(rows, ops.unpack_int8(q, x.dtype), scale)
    else:
        y = scaled_linear(rows, from_bands(q, CHUNK), scale)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
