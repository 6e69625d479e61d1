"""Linear layer: nn.Linear, plus the weight-streaming kernel for decode-sized batches.

At a few rows a linear layer is bound by streaming its weights; the custom kernel
(kernels/linear_bf16.cpp, bf16 and fp32) gets 1.3-2.5x more bandwidth than oneDNN there on AVX512-BF16 CPUs.
Above a number of rows that depends on the CPU class and dtype (kernels.small_batch_rows: 4 in bf16 where
a tile kernel on packed weights takes over, 64 in fp32 and on AVX2), something faster takes over. The switch
is process-wide and set once by the model runner; a graph sees it as a constant, so the choice is made when a bucket is traced.
A layer can also be quantized in place to weight-only int8 or int4 (quant_int8.py, quant_int4.py),
whose few-row kernels are switched on by the runner too. On AVX512-BF16 and AMX CPUs the rows above the
kernel's take copies of the weights packed once at load (packed_weights.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_kernel_dtypes: frozenset[torch.dtype] = frozenset()
_kernel_rows = 0
_quant_kernels_enabled = False
_prepacked = False


def set_small_batch_kernel(dtypes: frozenset[torch.dtype], rows: int) -> None:
    """Inputs of these dtypes with up to `rows` rows take the weight-streaming kernel (empty: none). One
    limit for the process (the runner's compute dtype's): a graph guards on plain globals only."""
    global _kernel_dtypes, _kernel_rows
    _kernel_dtypes, _kernel_rows = frozenset(dtypes), rows


def set_prepacked(enabled: bool) -> None:
    """bf16 inputs above the kernel's rows take copies of the weights packed once at load (packed_weights.py)."""
    global _prepacked
    _prepacked = enabled


def set_quant_kernels(enabled: bool) -> None:
    global _quant_kernels_enabled
    _quant_kernels_enabled = enabled


def _scheme(name: str):
    from vllm_neuron.model.layers import quant_int4, quant_int8

    return {"int8": quant_int8, "int4": quant_int4}[name]


class Linear(nn.Linear):
    quantization: str | None = None

    def quantize_(self, scheme: str) -> None:
        """Replaces the weight by its `scheme` form (buffers `qweight`, `qscale`; the bias, if any, stays);
        a tied weight stays with its other owner."""
        qweight, qscale = _scheme(scheme).quantize(self.weight)
        del self.weight
        self.register_buffer("qweight", qweight)
        self.register_buffer("qscale", qscale)
        self.quantization = scheme

    def make_fp8_(self) -> None:
        """Holds an FP8 checkpoint's weight as it is stored (float8_e4m3fn) with one fp32 scale per output
        row (`weight_scale`), both filled by the checkpoint loader (quant_fp8.py)."""
        from vllm_neuron.model.layers.quant_fp8 import FP8_DTYPE

        shape, device = self.weight.shape, self.weight.device
        self.weight = nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE, device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(shape[0], dtype=torch.float32, device=device), requires_grad=False)
        self.quantization = "fp8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantization == "fp8":
            from vllm_neuron.model.layers.quant_fp8 import linear

            return linear(x, self.weight, self.weight_scale, self.bias)
        if self.quantization is not None:
            return _scheme(self.quantization).linear(x, self.qweight, self.qscale, self.bias, _quant_kernels_enabled)
        if (x.dtype in _kernel_dtypes and x.dim() == 2 and x.shape[0] <= _kernel_rows and self.bias is None
                and self.weight.dtype == x.dtype and self.in_features % 32 == 0):
            from vllm_neuron.model.layers.kernels import linear_small_batch

            return linear_small_batch(x, self.weight)
        if _prepacked and x.dtype == torch.bfloat16 and x.dim() == 2 and self.weight.dtype == x.dtype:
            from vllm_neuron.model.layers.packed_weights import linear_prepacked

            return linear_prepacked(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def make_linears_fp8_(model: nn.Module, exclude: list[str]) -> int:
    """Turns every `Linear` not matched by `exclude` (and not sharing its weight with an embedding) into an
    FP8 holder before an FP8 checkpoint loads; returns how many."""
    from vllm_neuron.model.layers.quant_fp8 import excluded

    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and id(module.weight) not in shared and not excluded(name, exclude):
            module.make_fp8_()
            count += 1
    return count


def quantize_linears_(model: nn.Module, scheme: str) -> tuple[int, int, int]:
    """Quantizes every `Linear` of `model` in place to `scheme`; (layers, bytes before, bytes after)."""
    layers = before = after = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.quantization is None:
            before += module.weight.numel() * module.weight.element_size()
            module.quantize_(scheme)
            after += sum(t.numel() * t.element_size() for t in (module.qweight, module.qscale))
            layers += 1
    return layers, before, after

