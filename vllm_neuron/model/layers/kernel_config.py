"""Which custom kernels a model's layers and graphs take, decided once per engine and handed to the model
when it is built (`apply_kernel_config`), never a process-wide switch: two engines in one process may
differ (one with the kernels, one without), and a graph traced for one sees its own choice as constants.

Layers that have a kernel path (Linear, the gated MLP's activation, the MoE experts) carry a `kernels`
attribute, all off by default, so a model built outside an engine (a test, transformers parity) runs the
torch paths that compute the same thing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from vllm_neuron.model.layers.kernels import cpu_caps
from vllm_neuron.model.layers.kernels.ops import has_op


@dataclass(frozen=True)
class KernelConfig:
    attention: bool = False  # paged attention by the custom kernel (prefill, decode, verify)
    linear_dtypes: frozenset = frozenset()  # input dtypes the weight-streaming linear takes...
    linear_rows: int = 0  # ...up to this many rows
    quant_rows: int = 0  # the int8 / int4 kernels up to this many rows (0: none; cpu_caps.quant_kernel_rows)
    prepacked: bool = False  # bf16 rows above `linear_rows` take weights packed once at load (packed_weights.py)
    tile_rows: int = 0  # ...through the C++ tile-copy lookup up to this many rows (0: the Python lookup only)
    # bf16 rows above `linear_rows` (`quant_rows` for int8 / int4 layers) run in fp32 on the weights widened (or
    # unpacked) per call, where the CPU has no bf16 matmul (AVX2 class: oneDNN emulates bf16 there, 4-5x slower
    # than its fp32; cpu_caps.widen_pays)
    widen_bf16: bool = False
    sampler: bool = False  # the grammar mask and greedy argmax kernels on CPU logits
    activation: bool = False  # bf16 silu(gate) * up in one pass
    lora: bool = False  # LoRA's per-token shrink and expand in one op (decode-sized steps)
    # int4 / int8 layers take weights in a tile order of their own against inputs made int8 per group of 32:
    # int4 at every row count (the copy replaces its bands), int8 from two rows on (beside its bands)
    # (kernels/linear_int4_tiles.cpp, linear_int8_tiles.cpp; neuron_config.int8_activations)
    int8_activations: bool = False

    def matmul_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a matmul above the kernels' rows runs in, for inputs of `dtype` (`widen_bf16`)."""
        return torch.float32 if self.widen_bf16 and dtype == torch.bfloat16 else dtype

    def graph_options(self) -> dict:
        """What of this shapes the traced graphs (part of the compile-cache key)."""
        return {f.name: sorted(map(str, v)) if isinstance(v, frozenset) else v
                for f, v in ((f, getattr(self, f.name)) for f in dataclasses.fields(self))}


def resolve_kernel_config(device: torch.device, dtype: torch.dtype, int8_activations: bool = True) -> KernelConfig:
    """The kernels this device and dtype take here (builds the kernels on the first CPU call);
    `int8_activations` lets int4 / int8 layers take the int8-activation kernels where they are built
    (AVX512-VNNI)."""
    if not cpu_caps.kernels_enabled(device):
        return KernelConfig()
    rows = cpu_caps.linear_kernel_rows(device).get(dtype, 0)
    prepacked = cpu_caps.packing_pays(device, dtype, cpu_caps.cpu_flags())
    tile = cpu_caps.tile_kernel() if prepacked else None
    tile_rows = tile[1] if tile is not None and has_op("linear_tiles") else 0
    return KernelConfig(attention=True, linear_dtypes=cpu_caps.linear_kernel_dtypes(device), linear_rows=rows,
                        quant_rows=cpu_caps.quant_kernel_rows(device, dtype),
                        prepacked=prepacked, tile_rows=tile_rows,
                        widen_bf16=cpu_caps.widen_pays(device, dtype, cpu_caps.kernel_variant()[0]),
                        sampler=True, activation=True,
                        lora=has_op("lora_delta"),
                        int8_activations=int8_activations and has_op("linear_int8_tiles")
                        and dtype in (torch.bfloat16, torch.float32))


def apply_kernel_config(model: nn.Module, kernels: KernelConfig) -> int:
    """Hands `kernels` to every layer of `model` that has a kernel path; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(getattr(type(module), "kernels", None), KernelConfig):
            module.kernels = kernels
            count += 1
    return count
