"""Weight-only int4 for CPU (`neuron_config.quantization: "int4"`): groups of 32 along the input dimension,
an fp32 scale and minimum per group (w = q * scale + min, q in 0..15).

A batch-1 decode step streams every weight once, so its time follows the weight bytes: 0.75 bytes per
weight here against bf16's 2. Up to `kernel_rows` rows (cpu_caps.quant_kernel_rows) the project's kernel
(kernels/linear_quant.cpp) dequantizes in registers, or per band into L1, and reads each weight byte once;
above, a prefill-sized input dequantizes the
weight to the activation dtype inside the graph (one pass in the kernel library where it is built) and
takes the ordinary (compute-efficient) matmul.

Packing: two groups form a 64-weight superblock of 32 bytes whose byte j holds weight j (low nibble)
and weight j + 32 (high nibble), the order the kernel widens in one AND and one shift. Bytes and scales
are stored in the band order the kernel streams fastest (quant_bands.py, one superblock per chunk). GGUF Q4_1
checkpoints (same 32-wide blocks, w = d * q + m) come back exactly when each block uses its full range.

With int8 activations (AVX512-VNNI CPUs, neuron_config.int8_activations) a layer holds `to_tiles`' copy instead
of the bands: the W4A8 kernel serves every row count, one row as fast as the band kernel (both stream 0.75
bytes a weight), so every batch size computes alike.
"""
from __future__ import annotations

import torch

from vllm_neuron.model.layers.kernels import ops
from vllm_neuron.model.layers.quant_bands import from_bands, to_bands

GROUP_SIZE = 32
SUPERBLOCK = 2 * GROUP_SIZE


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K / 2], scales float32 [N, K / 32, 2] = (scale, min), both in band layout) of a
    [N, K] weight."""
    n, k = weight.shape
    if k % SUPERBLOCK:
        raise ValueError(f"int4 quantization needs in_features divisible by {SUPERBLOCK} (two groups of "
                         f"{GROUP_SIZE}, the kernel's layout), got a [{n}, {k}] weight")
    w = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = ((w - lo) / scale).round_().clamp_(0, 15).to(torch.uint8).reshape(n, k // SUPERBLOCK, 2, GROUP_SIZE)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2)
    scales = torch.cat([scale, lo], -1).reshape(n, k // 16)
    return to_bands(packed, SUPERBLOCK // 2), to_bands(scales, 4).reshape(n, k // GROUP_SIZE, 2)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight in `dtype` (computed in float32)."""
    n = packed.shape[0]
    b = from_bands(packed, SUPERBLOCK // 2).reshape(n, -1, 1, GROUP_SIZE)
    scales = from_bands(scales.reshape(n, -1), 4).reshape(n, -1, 2)
    q = torch.cat([b & 15, b >> 4], 2).reshape(n, -1, GROUP_SIZE).float()
    return torch.addcmul(scales[..., 1:], q, scales[..., :1]).reshape(n, -1).to(dtype)


def to_tiles(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The W4A8 kernel's copy (kernels/linear_int4_tiles.cpp) of a band-layout weight, N a multiple of 16: codes
    uint8 [N, K / 2] as [N / 16][K / 8][16 columns][4 bytes], byte b of column c holding input 8o + b in its low
    nibble and 8o + 4 + b in its high one; scales float32 [N, K / 32, 2] as [N / 16][K / 32][scale, min +
    8 * scale][16] (the kernel multiplies the centred codes q - 8)."""
    n = packed.shape[0]
    b = from_bands(packed, SUPERBLOCK // 2).reshape(n, -1, 1, GROUP_SIZE)
    q = torch.cat([b & 15, b >> 4], 2).reshape(n // 16, 16, -1, 2, 4)  # [block, column, octet, half, byte]
    codes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    sm = centred_scales(from_bands(scales.reshape(n, -1), 4).reshape(n, -1, 2))
    sm = sm.reshape(n // 16, 16, -1, 2).permute(0, 2, 3, 1).contiguous()
    return codes.reshape(n, -1), sm.reshape(n, -1, 2)


def tile_groups(codes: torch.Tensor, sm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`to_tiles`' copy (or whole 16-column blocks of it: rows a..b of both, a and b multiples of 16) back in
    row order: codes uint8 [N, K / 32, 32] (0..15) and (scale, min + 8 * scale) float32 [N, K / 32, 2]."""
    n = codes.shape[0]
    c = codes.reshape(n // 16, -1, 16, 4).permute(0, 2, 1, 3)  # [block, column, octet, byte]
    q = torch.stack([c & 15, c >> 4], 3)  # [block, column, octet, half, byte]: input 8o + 4h + b
    sm = sm.reshape(n // 16, -1, 2, 16).permute(0, 3, 1, 2)
    return q.reshape(n, -1, GROUP_SIZE), sm.reshape(n, -1, 2)


def dequantize_tiles(codes: torch.Tensor, sm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight of `to_tiles`' copy (or of whole blocks of it) in `dtype` (computed in float32)."""
    q, sm = tile_groups(codes, sm)
    return torch.addcmul(sm[..., 1:], q.float() - 8, sm[..., :1]).reshape(q.shape[0], -1).to(dtype)


def centred_scales(sm: torch.Tensor) -> torch.Tensor:
    """(scale, min) [..., 2] -> (scale, min + 8 * scale) in float32: w = (q - 8) * scale + that."""
    return torch.stack([sm[..., 0], sm[..., 1] + 8 * sm[..., 0]], -1)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] made int8 per row and group of 32, as the W4A8 kernel does: (codes int8 [M, K], scales
    max|x| / 127 [M, K / 32], the groups' exact sums [M, K / 32]), all but the codes float32 (reference)."""
    g = x.float().reshape(x.shape[0], -1, GROUP_SIZE)
    amax = g.abs().amax(-1)
    # torch.div, not `127 / amax`: Tensor.__rtruediv__ multiplies by the reciprocal, rounding twice.
    inv = torch.where(amax > 0, torch.full_like(amax, 127).div(amax), torch.zeros_like(amax))
    codes = (g * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)
    return codes.reshape(x.shape), amax / 127, g.sum(-1)


def linear_w4a8_reference(x: torch.Tensor, codes: torch.Tensor, sm: torch.Tensor) -> torch.Tensor:
    """What the W4A8 kernel computes from `to_tiles`' copy, in float64 torch (tests): per group, scale * d_x *
    sum((q - 8) * qx) + (min + 8 * scale) * sum(x)."""
    m = x.shape[0]
    q, sm = tile_groups(codes, sm)
    q, sm = q.double() - 8, sm.double()  # [N, G, 32], [N, G, 2]
    xq, d, sums = quantize_activations(x)
    dots = torch.einsum("ngk,mgk->mng", q, xq.reshape(m, -1, GROUP_SIZE).double())
    return (dots * sm[..., 0] * d.double().unsqueeze(1) + sm[..., 1] * sums.double().unsqueeze(1)).sum(-1)


def linear(x: torch.Tensor, packed: torch.Tensor | None, scales: torch.Tensor | None, bias: torch.Tensor | None,
           kernel_rows: int, tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
           compute: torch.dtype | None = None) -> torch.Tensor:
    """x @ W^T (+ bias): with `tiles` (`to_tiles`' copy, which then replaces the bands: packed and scales None)
    the W4A8 kernel at every row count, one row included (as fast as the band kernel there: both stream 0.75
    bytes a weight); else the band kernel up to `kernel_rows` rows, its one-pass dequantization + matmul above
    (in `compute`, x's dtype by default: KernelConfig.matmul_dtype); torch alone where kernel_rows is 0 (no kernel
    build)."""
    rows = x.reshape(-1, x.shape[-1])
    if tiles is not None:
        y = ops.linear_int4_tiles(rows, *tiles)
        if bias is not None:
            y = y + bias
    elif rows.shape[0] <= kernel_rows:
        y = ops.linear_int4(rows, packed, scales)
        if bias is not None:
            y = y + bias
    elif kernel_rows:
        compute = compute or rows.dtype
        y = torch.nn.functional.linear(rows.to(compute), ops.unpack_int4(packed, scales, compute),
                                       None if bias is None else bias.to(compute)).to(rows.dtype)
    else:
        y = torch.nn.functional.linear(rows, dequantize(packed, scales, x.dtype), bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])
