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
GROUP_SIZE = 32  # inputs per activation group of the W8A8 kernel
# Where the layer has the W8A8 copy, the rows from which it takes it (one row: the VNNI kernel's int16 inputs).
TILE_ROWS_FROM = 2


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


def to_tiles(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The W8A8 kernel's copy (kernels/linear_int8_tiles.cpp) of a band-layout q, N a multiple of 16 and K of
    32: codes int8 [N, K] as [N / 16][K / 4][16 columns][4], and 128 x each column's sum over each group of 32
    inputs, int32 [N / 16, K / 32, 16] (the kernel's unsigned activations add it)."""
    n = q.shape[0]
    rows = from_bands(q, CHUNK)
    codes = rows.reshape(n // 16, 16, -1, 4).permute(0, 2, 1, 3).contiguous().reshape(n, -1)
    corr = rows.reshape(n // 16, 16, -1, GROUP_SIZE).sum(-1, dtype=torch.int32).mul_(128).permute(0, 2, 1)
    return codes, corr.contiguous()


def linear_w8a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the W8A8 kernel computes, in float64 torch (tests): per group, d_x * sum(q * qx), times the scale."""
    from vllm_neuron.model.layers.quant_int4 import quantize_activations

    n, m = q.shape[0], x.shape[0]
    rows = from_bands(q, CHUNK).double().reshape(n, -1, GROUP_SIZE)
    xq, d, _ = quantize_activations(x)
    dots = torch.einsum("ngk,mgk->mng", rows, xq.reshape(m, -1, GROUP_SIZE).double())
    return (dots * d.double().unsqueeze(1)).sum(-1) * scale.double()


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
           kernel_rows: int, tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
           compute: torch.dtype | None = None) -> torch.Tensor:
    """x @ W^T (+ bias): with `tiles` (`to_tiles`' copy) the W8A8 kernel from TILE_ROWS_FROM rows; else the
    kernel up to `kernel_rows` rows, its one-pass unpacking + matmul above (in `compute`, x's dtype by default:
    KernelConfig.matmul_dtype); torch alone where kernel_rows is 0 (no kernel build)."""
    rows = x.reshape(-1, x.shape[-1])
    if tiles is not None and rows.shape[0] >= TILE_ROWS_FROM:
        y = ops.linear_int8_tiles(rows, tiles[0], tiles[1], scale)
    elif rows.shape[0] <= kernel_rows:
        y = ops.linear_int8(rows, q, scale)
    elif kernel_rows:
        compute = compute or rows.dtype
        y = scaled_linear(rows.to(compute), ops.unpack_int8(q, compute), scale).to(rows.dtype)
    else:
        y = scaled_linear(rows, from_bands(q, CHUNK), scale)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
