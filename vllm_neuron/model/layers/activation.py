"""Gated MLP activations: silu(gate) * up from a fused gate_up projection's output."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(h: torch.Tensor, use_kernel: bool = False) -> torch.Tensor:
    """[..., 2I] (gate, then up) -> silu(gate) * up, [..., I]. With `use_kernel` (the caller's
    KernelConfig.activation) bf16 on the CPU takes the fused kernel (kernels/activation.cpp), which rounds once
    from fp32; fp32 and other dtypes keep torch's silu (fp32 greedy output stays token-identical to
    transformers)."""
    if use_kernel and h.dtype == torch.bfloat16 and h.device.type == "cpu":
        return torch.ops.vllm_neuron.silu_and_mul(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up
