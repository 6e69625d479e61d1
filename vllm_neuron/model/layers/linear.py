"""Linear layer: nn.Linear, plus the weight-streaming kernel for decode-sized batches.

At a few rows a linear layer is bound by streaming its weights; the custom kernel
(kernels/linear_bf16.cpp, bf16 and fp32) gets 1.3-2.5x more bandwidth than oneDNN there on AVX512-BF16 CPUs. From
SMALL_BATCH_ROWS rows on, oneDNN is as fast and takes over. The switch is process-wide and set once
by the model runner; a graph sees it as a constant, so the choice is made when a bucket is traced.
A layer can also be quantized in place to weight-only int4 (quant_int4.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = 4
_kernel_dtypes: frozenset[torch.dtype] = frozenset()


def set_small_batch_kernel(dtypes: frozenset[torch.dtype]) -> None:
    """The dtypes whose small batches take the weight-streaming kernel (empty: none)."""
    global _kernel_dtypes
    _kernel_dtypes = frozenset(dtypes)


class Linear(nn.Linear):
    quantization: str | None = None

    def quantize_int4_(self) -> None:
        """Replaces the weight by its int4 form (the bias, if any, stays); a tied weight stays with its
        other owner."""
        from vllm_neuron.model.layers.quant_int4 import quantize_int4

        packed, nibbles, scale_zeros = quantize_int4(self.weight, self.weight.dtype)
        del self.weight
        self.register_buffer("qweight", packed)
        self.register_buffer("qnibbles", nibbles)
        self.register_buffer("qscale_zeros", scale_zeros)
        self.quantization = "int4"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantization == "int4":
            from vllm_neuron.model.layers.quant_int4 import int4_linear

            return int4_linear(x, self.qweight, self.qnibbles, self.qscale_zeros, self.bias)
        if (x.dtype in _kernel_dtypes and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS and self.bias is None
                and self.weight.dtype == x.dtype and self.in_features % 32 == 0):
            from vllm_neuron.model.layers.kernels import linear_small_batch

            return linear_small_batch(x, self.weight)
        return F.linear(x, self.weight, self.bias)


def quantize_linears_int4_(model: nn.Module) -> tuple[int, int, int]:
    """Quantizes every `Linear` of `model` in place; (layers, bytes before, bytes after)."""
    layers = before = after = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.quantization is None:
            before += module.weight.numel() * module.weight.element_size()
            module.quantize_int4_()
            after += sum(t.numel() * t.element_size() for t in (module.qweight, module.qnibbles, module.qscale_zeros))
            layers += 1
    return layers, before, after
