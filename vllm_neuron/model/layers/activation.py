"""Gated MLP activations: silu(gate) * up from a fused gate_up projection's output."""
from __future__ import annotations

import torch
import torch.nn.functional as F

_cpu_kernel_on = False


def set_activation_kernel(enabled: bool) -> None:
    """bf16 activations on the CPU take the fused kernel (kernels/activation.cpp); set once by the runner when
    the custom kernels are built, as a plain global a graph can read."""
    global _cpu_kernel_on
    _cpu_kernel_on = enabled


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """[..., 2I] (gate, then up) -> silu(gate) * up, [..., I]. fp32 and other dtypes keep torch's silu (fp32
    greedy output stays token-identical to transformers); bf16 on the CPU kernels rounds once, from fp32."""
    if _cpu_kernel_on and h.dtype == torch.bfloat16 and h.device.type == "cpu":
        return torch.ops.vllm_neuron.silu_and_mul(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up
