"""Linear layer: nn.Linear, plus the weight-streaming kernel for decode-sized batches.

At a few rows a linear layer is bound by streaming its weights; the custom kernel
(kernels/linear_bf16.cpp, bf16 and fp32) gets 1.3-2.5x more bandwidth than oneDNN there on AVX512-BF16 CPUs.
Above a number of rows that depends on the CPU class and dtype (cpu_caps.small_batch_rows: 4 in bf16 where
a tile kernel on packed weights takes over, 64 in fp32 and on AVX2), something faster takes over. Which
kernels a layer takes is its `kernels` (a KernelConfig the engine hands to the model it builds); a graph sees
it as constants, so the choice is made when a bucket is traced. A layer can also be quantized in place to
weight-only int8 or int4 (quant_int8.py, quant_int4.py), whose few-row kernels the same config switches on.
On AVX512-BF16 and AMX CPUs the rows above the kernel's take copies of the weights packed once at load
(packed_weights.py); on AVX2 CPUs, which have no bf16 matmul, bf16 rows above the kernel's run in fp32 on the
weights widened per call (`kernels.widen_bf16`): oneDNN's emulated bf16 took 3.6-3.7x as long for a prefill step.
With LoRA on, the layer also holds its adapters' slot table (`lora`, model/layers/lora.py) and adds each
token's adapter delta, computed in the compute dtype beside the (possibly quantized) base matmul.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from vllm_neuron import huge_pages
from vllm_neuron.model.layers import packed_weights, quant_error, quant_fp8, quant_int4, quant_int8
from vllm_neuron.model.layers.kernel_config import KernelConfig
from vllm_neuron.model.layers.kernels.ops import linear_small_batch


def _scheme(name: str):
    return {"int8": quant_int8, "int4": quant_int4}[name]


class Linear(nn.Linear):
    quantization: str | None = None
    kernels = KernelConfig()  # the engine's, set when the model is built (kernel_config.apply_kernel_config)

    def quantize_(self, scheme: str, tiles: bool = False) -> None:
        """Replaces the weight by its `scheme` form (buffers `qweight`, `qscale`; the bias, if any, stays);
        a tied weight stays with its other owner. `tiles` (int4, int8): the int8-activation kernel's copy
        (`qtiles`, `qtile_extra`) where the shape takes it (`tiles_fit`): int4's replaces the bands (its kernel
        serves every row count), int8's sits beside the bands its one-row kernel streams (faster there)."""
        qweight, qscale = _scheme(scheme).quantize(self.weight)
        del self.weight
        self.quantization = scheme
        if tiles and tiles_fit(self.out_features, self.in_features):
            codes, extra = quant_int4.to_tiles(qweight, qscale) if scheme == "int4" else quant_int8.to_tiles(qweight)
            self.register_buffer("qtiles", codes)
            self.register_buffer("qtile_extra", extra)  # int4: (scale, min) in tile order; int8: group corrections
            if scheme == "int4":
                return
        self.register_buffer("qweight", qweight)
        self.register_buffer("qscale", qscale)

    def make_fp8_(self) -> None:
        """Holds an FP8 checkpoint's weight as it is stored (float8_e4m3fn) with one fp32 scale per output
        row (`weight_scale`), both filled by the checkpoint loader (quant_fp8.py)."""
        shape, device = self.weight.shape, self.weight.device
        self.weight = nn.Parameter(torch.empty(shape, dtype=quant_fp8.FP8_DTYPE, device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(shape[0], dtype=torch.float32, device=device), requires_grad=False)
        self.quantization = "fp8"

    def forward(self, x: torch.Tensor, lora_index: torch.Tensor | None = None) -> torch.Tensor:
        """`lora_index` [rows]: each row's adapter slot (0: none); given only to layers with LoRA attached
        (`self.lora`, a LoRASlots: model/layers/lora.py)."""
        y = self._base(x)
        if lora_index is None:
            return y
        return y + self.lora(x, lora_index).to(y.dtype)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        k = self.kernels
        if self.quantization == "fp8":
            return quant_fp8.linear(x, self.weight, self.weight_scale, self.bias)
        if self.quantization == "int4" and hasattr(self, "qtiles"):
            return quant_int4.linear(x, None, None, self.bias, k.quant_rows, tiles=(self.qtiles, self.qtile_extra))
        if self.quantization == "int8" and hasattr(self, "qtiles"):
            return quant_int8.linear(x, self.qweight, self.qscale, self.bias, k.quant_rows,
                                     tiles=(self.qtiles, self.qtile_extra))
        if self.quantization is not None:
            return _scheme(self.quantization).linear(x, self.qweight, self.qscale, self.bias, k.quant_rows,
                                                     compute=k.matmul_dtype(x.dtype))
        if (x.dtype in k.linear_dtypes and x.dim() == 2 and x.shape[0] <= k.linear_rows and self.bias is None
                and self.weight.dtype == x.dtype and self.in_features % 32 == 0):
            return linear_small_batch(x, self.weight)
        if k.prepacked and x.dtype == torch.bfloat16 and x.dim() == 2 and self.weight.dtype == x.dtype:
            return packed_weights.linear_prepacked(x, self.weight, self.bias, k.tile_rows)
        return _linear_in(x, self.weight, self.bias, k.matmul_dtype(x.dtype))


class EncoderLinear(nn.Linear):
    """nn.Linear for encoders' layers (vision, audio, BERT, pooling heads): none of Linear's few-row kernels,
    packing or quantization (those serve a decoder's steps), but bf16 runs in the same `kernels.matmul_dtype`
    (fp32 on weights widened per call on the AVX2 class, where oneDNN emulates bf16 at a fifth of its speed)."""
    kernels = KernelConfig()  # the engine's, set when the model is built (kernel_config.apply_kernel_config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear_in(x, self.weight, self.bias, self.kernels.matmul_dtype(x.dtype))


def _linear_in(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, compute: torch.dtype) -> torch.Tensor:
    """F.linear computed in `compute`, the result in x's dtype."""
    if compute == x.dtype or weight.dtype != x.dtype:
        return F.linear(x, weight, bias)
    bias = None if bias is None else bias.to(compute)
    return F.linear(x.to(compute), weight.to(compute), bias).to(x.dtype)


def make_linears_fp8_(model: nn.Module, exclude: list[str]) -> int:
    """Turns every `Linear` not matched by `exclude` (and not sharing its weight with an embedding) into an
    FP8 holder before an FP8 checkpoint loads; returns how many."""
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and id(module.weight) not in shared and not quant_fp8.excluded(name, exclude):
            module.make_fp8_()
            count += 1
    return count


def quantize_linears_(model: nn.Module, scheme: str, errors: dict[str, quant_error.QuantError] | None = None,
                      schemes: dict[str, str] | None = None, tiles: bool = False) -> tuple[int, int, int]:
    """Quantizes every `Linear` of `model` in place to `scheme` (or `schemes[module name]`); (layers, bytes before,
    bytes after). With `errors`, each layer's error against its weight before quantization is recorded there by
    module name; `tiles`: int4 / int8 layers also get the int8-activation kernels' copy (Linear.quantize_)."""
    layers = before = after = 0
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quantization is None:
            weight = module.weight
            before += weight.numel() * weight.element_size()
            module.quantize_((schemes or {}).get(name, scheme), tiles=tiles)
            after += sum(t.numel() * t.element_size() for t in module.buffers(recurse=False))
            layers += 1
            if errors is not None:
                errors[name] = quant_error.measure(weight, functools.partial(_dequantize_rows, module))
    return layers, before, after



def tiles_fit(n: int, k: int) -> bool:
    """Whether a [n, k] weight takes the int8-activation kernels' tile order (16 columns x groups of 32; int4
    asks K % 64 of its own)."""
    return n % 16 == 0 and k % 32 == 0


def tile_bytes(model: nn.Module, scheme: str, schemes: dict[str, str] | None = None) -> int:
    """What the int8-activation copies of `model`'s unquantized Linear weights would add once quantized to
    `scheme` (or `schemes[module name]`): nothing for int4 (its copy replaces the bands, byte for byte), for int8
    a byte per weight and 4 bytes per column and group of 32 beside its bands."""
    return sum(int(m.weight.numel() * 1.125) for name, m in model.named_modules()
               if isinstance(m, Linear) and m.quantization is None and tiles_fit(m.out_features, m.in_features)
               and (schemes or {}).get(name, scheme) == "int8")


def _dequantize_rows(module: Linear, a: int, b: int) -> torch.Tensor:
    """Rows a..b of a quantized layer's weight in float32 (whole bands or tile blocks: a and b multiples of 16,
    or b the end)."""
    if not hasattr(module, "qweight"):  # int4's tile copy alone
        return quant_int4.dequantize_tiles(module.qtiles[a:b], module.qtile_extra[a:b], torch.float32)
    return _scheme(module.quantization).dequantize(module.qweight[a:b], module.qscale[a:b], torch.float32)


def _packable(model: nn.Module) -> list[torch.Tensor]:
    """The unquantized, contiguous 2-D bf16 weights of `model`'s `Linear` layers, one entry per layer."""
    return [m.weight for m in model.modules()
            if isinstance(m, Linear) and m.quantization is None and getattr(m, "weight", None) is not None
            and m.weight.dtype == torch.bfloat16 and m.weight.dim() == 2 and m.weight.is_contiguous()]


def packed_bytes(model: nn.Module) -> int:
    """What `pack_linears_` would add: one or two copies of each distinct weight (packed_weights.copies_for)."""
    distinct = {w.data_ptr(): w for w in _packable(model) if not packed_weights.is_packed(w)}
    return sum(w.numel() * w.element_size() * sum(packed_weights.copies_for(w)) for w in distinct.values())


def pack_linears_(model: nn.Module) -> tuple[int, int]:
    """Packs every unquantized bf16 `Linear` weight of `model` once (a tied weight once): the tile-order copy
    where a tile kernel is built and takes the shape, oneDNN's reorder for the rows it leaves; returns
    (layers, bytes added)."""
    weights = _packable(model)
    # The tile copies side by side in huge pages: those the decode steps above 4 rows stream (one step's at 16
    # rows 17.9 -> 16.6 ms against one 4 KiB-page copy each, bundled model, 2-core Zen 4 EPYC, 2026-12-06).
    arena = huge_pages.Arena(packed_weights.tile_bytes(list({w.data_ptr(): w for w in weights}.values())))
    return len(weights), sum(packed_weights.pack(w, arena) for w in weights)
