"""Linears on weights packed once at load (AVX512-BF16 and AMX CPUs), for the rows the weight-streaming kernel
leaves.

`F.linear` on bf16 hands oneDNN a plain [N, K] weight, and on a Xeon with AMX oneDNN reorders it into its
tile layout on every call: at decode and small prefill sizes that reorder is most of the call. Reordered once
at load (what inductor's weight prepacking does under freezing, which our compile cache cannot take: it bakes
the weights into the graph), one decode step's linears of the bundled model took 27.7 instead of 37.8 ms at 16
rows, 40.3 instead of 62.7 at 64, 67.6 instead of 100.9 at 128 and 258 instead of 281 at 512 (2 threads,
2026-12-02).

Still, oneDNN read those weights at about half the memory bandwidth up to 32 rows, where a step's linears are
bound by that read. Up to `_AMX_ROWS` rows our tile kernel (kernels/linear_amx.cpp) streams a second copy
packed in tile order: 18.3 vs 28.3 ms at 16 rows, 22.0 vs 39.9 at 32, level at 64 (43.3 vs 39.6), and
17.8-18.6 vs 27.7-30.4 at 4-8 rows (2 threads, 2026-12-03).

Without AMX (a Zen 5 EPYC with AVX512-BF16, 2026-12-04) oneDNN reorders on every call too, for its
VDPBF16PS layout: on the bundled model's shapes the reordered weight ran 10-25% faster at 32-128 rows and ~5%
at 512 (e.g. [128, 576] x [576, 960]: 880 vs 764 GFLOP/s), and the prefill steps above the kernel's 32 rows
took 26.6-28.8 instead of 29.9-39.3 ms at s64, 41.7-42.0 instead of 44.6-56.6 at s128 and 143.5-144.0 instead
of 148.1-174.6 at s512 (step_bounds, processes in turn). The weight-streaming kernel stays ahead at 16 rows
there (decode_b16 11.0-11.9 vs 14.4-15.1 ms on the reordered weights), so its 32 rows stand.

The copies live beside the plain weight (the weight-streaming kernel reads that one at one to four rows), in
a registry keyed by the plain weight's storage: a graph passes the plain weight, which keeps its shapes and
the compile cache's guards as they were, and the op finds the copies. A weight without copies (a process that
did not pack) takes F.linear, so a cached graph computes the same either way.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

# Rows the reorder is tuned for. Tuned for 128, the 512-row prefill took 305 ms instead of F.linear's 281; tuned
# for 512, 258 ms, with 64 rows unchanged (26 ms).
_ROWS_HINT = 512
# Up to this many rows the tile kernel's copy serves (measured above; its four C tiles stop at 64).
_AMX_ROWS = 32
# storage address -> (the plain weight's shape, oneDNN's reordered copy, the tile kernel's copy or None); an
# entry leaves with its weight.
_packed: dict[int, tuple[torch.Size, torch.Tensor, torch.Tensor | None]] = {}


def available(device: torch.device, dtype: torch.dtype, cpu_flags: set[str]) -> bool:
    """Whether reordered weights pay here (pure but for torch's build): bf16 on a CPU with bf16 dot products
    in hardware (AVX512-BF16, AMX). On AVX2-only CPUs oneDNN emulates bf16 and the kernel serves more rows."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and bool({"amx_bf16", "avx512_bf16"} & cpu_flags)
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packable(model: nn.Module) -> list[torch.Tensor]:
    """The unquantized, contiguous 2-D bf16 weights of `model`'s `Linear` layers, one entry per layer."""
    from vllm_neuron.model.layers.linear import Linear

    return [m.weight for m in model.modules()
            if isinstance(m, Linear) and m.quantization is None and getattr(m, "weight", None) is not None
            and m.weight.dtype == torch.bfloat16 and m.weight.dim() == 2 and m.weight.is_contiguous()]


def packed_bytes(model: nn.Module) -> int:
    """What `pack_linears_` would add: a copy of each distinct weight (two where the tile kernel takes it)."""
    distinct = {w.data_ptr(): w for w in _packable(model) if w.data_ptr() not in _packed}
    return sum(w.numel() * w.element_size() * (1 + tile_kernel_fits(w)) for w in distinct.values())


def pack_linears_(model: nn.Module) -> tuple[int, int]:
    """Packs every unquantized bf16 `Linear` weight of `model` once (a tied weight once): oneDNN's reorder, and
    the tile kernel's copy where it is built and takes the shape; returns (layers, bytes added)."""
    weights = _packable(model)
    added = 0
    for w in weights:
        if w.data_ptr() not in _packed:
            tiles = pack_tiles(w) if tile_kernel_fits(w) else None
            _packed[w.data_ptr()] = (w.shape, torch.ops.mkldnn._reorder_linear_weight(w, _ROWS_HINT), tiles)
            weakref.finalize(w, _packed.pop, w.data_ptr(), None)
            added += w.numel() * w.element_size() * (1 + (tiles is not None))
    return len(weights), added


@functools.lru_cache(maxsize=1)
def tile_kernel_built() -> bool:
    """Whether this machine's kernel build has the AMX tile linear (an avx512bf16 build on an AMX CPU) and it
    runs: a kernel older than Linux 5.16 hands out no tile state, and the probe's error keeps oneDNN serving."""
    from vllm_neuron.model.layers import kernels

    if not (kernels.kernels_enabled(torch.device("cpu")) and hasattr(torch.ops.vllm_neuron, "linear_amx")):
        return False
    try:
        w = torch.ones(16, 32, dtype=torch.bfloat16)
        y = torch.ops.vllm_neuron.linear_amx(torch.ones(1, 32, dtype=torch.bfloat16), pack_tiles(w), None, 16)
    except RuntimeError as e:
        logger.warning("AMX tile linear unavailable (%s); oneDNN serves every row count", e)
        return False
    return bool((y == 32).all())


def tile_kernel_fits(w: torch.Tensor) -> bool:
    """Whether the tile kernel is built here and takes w's shape (N a multiple of 16, K of 32)."""
    return tile_kernel_built() and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0


def pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] in the tile kernel's order: one B tile per 16 columns x 32 inputs, [N/16][K/32][16][16][2]."""
    n, k = w.shape
    return w.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


# A plain dispatcher kernel rather than torch.library.custom_op, whose wrapper cost ~25 us a call (121 calls a
# step on the bundled model: ~3 ms; measured 2026-12-03). A fragment: the C++ kernels define the namespace.
_lib = torch.library.Library("vllm_neuron", "FRAGMENT")
_lib.define("linear_prepacked(Tensor x, Tensor w, Tensor? bias) -> Tensor")
_linear_pointwise = torch.ops.mkldnn._linear_pointwise


_NO_COPIES = (None, None, None)


def _linear_prepacked(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape, reordered, tiles = _packed.get(w.data_ptr(), _NO_COPIES)
    if shape != w.shape:
        return F.linear(x, w, bias)
    if tiles is not None and x.shape[0] <= _AMX_ROWS and (bias is None or bias.dtype == torch.bfloat16):
        return torch.ops.vllm_neuron.linear_amx(x, tiles, bias, shape[0])
    return _linear_pointwise(x, reordered, bias, "none", [], "")


_lib.impl("linear_prepacked", _linear_prepacked, "CPU")


@torch.library.register_fake("vllm_neuron::linear_prepacked")
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def linear_prepacked(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias) through w's packed copies when it has them."""
    return torch.ops.vllm_neuron.linear_prepacked(x, w, bias)
