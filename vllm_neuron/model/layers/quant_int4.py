"""Weight-only int4 linear layers for CPU (`neuron_config.quantization: "int4"`), an opt-in for latency.

A batch-1 decode step streams every weight once, so its time follows the weight bytes: int4 groups
of 32 along the input dimension (an asymmetric scale and zero per group) read about a quarter of
bf16's bytes. Few rows run ATen's `_weight_int4pack_mm_for_cpu`; from INT4_KERNEL_ROWS rows on that
kernel is slower than a bf16 matmul (it grows with the rows), so prefill-sized inputs unpack the
weight to the activation dtype inside the graph and use the ordinary matmul.

GGUF checkpoints whose weights were 4-bit with the same 32-wide blocks (Q4_0, Q4_1) come back
almost exactly: only the scale and zero are rounded to the model dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

INT4_GROUP_SIZE = 32
INT4_KERNEL_ROWS = 16  # the int4 kernel up to this many rows, unpack + matmul above


def quantize_int4(weight: torch.Tensor, dtype: torch.dtype,
                  group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kernel-packed weight, nibble-packed weight [N, K/2] uint8, scale_zeros [K/group, N, 2] in `dtype`)
    of a [N, K] weight; dequantized, w = (q - 8) * scale + zero per group."""
    n, k = weight.shape
    if k % group_size or n % 16:
        raise ValueError(f"int4 quantization needs in_features divisible by {group_size} and out_features "
                         f"divisible by 16 (the kernel's layout), got a [{n}, {k}] weight")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = ((w - lo) / scale).round_().clamp_(0, 15).to(torch.uint8).reshape(n, k)
    scale_zeros = torch.stack([scale[..., 0], (lo + 8 * scale)[..., 0]], -1).transpose(0, 1).contiguous().to(dtype)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    nibbles = q[:, 0::2] | (q[:, 1::2] << 4)
    return packed, nibbles, scale_zeros


def dequantize_int4(nibbles: torch.Tensor, scale_zeros: torch.Tensor, dtype: torch.dtype,
                    group_size: int = INT4_GROUP_SIZE) -> torch.Tensor:
    """The [N, K] weight in `dtype` (computed in float32, as the int4 kernel does)."""
    n = nibbles.shape[0]
    q = torch.stack([nibbles & 15, nibbles >> 4], -1).reshape(n, -1, group_size).float()
    scale = scale_zeros[..., 0].t().float().unsqueeze(-1)
    zero = scale_zeros[..., 1].t().float().unsqueeze(-1)
    return ((q - 8) * scale + zero).reshape(n, -1).to(dtype)


@torch.library.custom_op("vllm_neuron::int4pack_mm", mutates_args=())
def int4pack_mm(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    # An opaque op for inductor: its own lowering of the ATen kernel fails inside nested compile regions.
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP_SIZE, scale_zeros)


@int4pack_mm.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


def int4_linear(x: torch.Tensor, packed: torch.Tensor, nibbles: torch.Tensor, scale_zeros: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= INT4_KERNEL_ROWS:
        y = int4pack_mm(rows.contiguous(), packed, scale_zeros)
        if bias is not None:
            y = y + bias
    else:
        y = F.linear(rows, dequantize_int4(nibbles, scale_zeros, x.dtype), bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


