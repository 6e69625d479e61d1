"""Linears on copies of the bf16 weights packed once at load (AVX512-BF16 and AMX CPUs), for the rows the
weight-streaming kernel leaves.

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

Without AMX (a Zen 5 EPYC with AVX512-BF16) the same tile-order copy feeds a VDPBF16PS outer-product kernel
(kernels/linear_dot_tiles.cpp) that beat both the weight-streaming kernel and oneDNN on reordered weights at
every row count from 8 to 512 (one step's linears, 30 layers, weights from memory: 5.2 vs 7.0 ms at 16 rows,
8.3 vs 12.1 at 32, 14.9 vs 20.8 at 64, 27.6 vs 32.9 at 128, 102 vs 109 at 512; 2026-12-04), so there it
serves every row above the weight-streaming kernel's four and oneDNN gets no copy. A weight whose shape the
tile kernels cannot take (N not a multiple of 16, K of 32) gets oneDNN's reordered copy instead.

The copies live beside the plain weight (the weight-streaming kernel reads that one at one to four rows), in
a registry keyed by the plain weight's storage: a graph passes the plain weight, which keeps its shapes and
the compile cache's guards as they were, and the op finds the copies. A weight without copies (a process that
did not pack) takes F.linear, so a cached graph computes the same either way. Tile copies are also registered
with a C++ lookup (kernels/linear_tile_copies.cpp) that graphs call within the tile kernel's rows: the Python
kernel's lookup cost ~2.5 us a call.
"""
from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from vllm_neuron import huge_pages
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

# Rows the reorder is tuned for. Tuned for 128, the 512-row prefill took 305 ms instead of F.linear's 281; tuned
# for 512, 258 ms, with 64 rows unchanged (26 ms).
_ROWS_HINT = 512
# Up to this many rows the AMX tile kernel's copy serves (measured above; its four C tiles stop at 64).
_AMX_ROWS = 32
# storage address -> (the plain weight's shape, oneDNN's reordered copy or None, the tile-order copy or None,
# the tile kernel and the most rows it serves); an entry leaves with its weight.
_packed: dict[int, tuple[torch.Size, torch.Tensor | None, torch.Tensor | None, object, int]] = {}


def available(device: torch.device, dtype: torch.dtype, cpu_flags: set[str]) -> bool:
    """Whether packed copies pay here (pure but for torch's build): bf16 on a CPU with bf16 dot products
    in hardware (AVX512-BF16, AMX). On AVX2-only CPUs oneDNN emulates bf16 and the kernel serves more rows."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and bool({"amx_bf16", "avx512_bf16"} & cpu_flags)
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _packable(model: nn.Module) -> list[torch.Tensor]:
    """The unquantized, contiguous 2-D bf16 weights of `model`'s `Linear` layers, one entry per layer."""
    from vllm_neuron.model.layers.linear import Linear

    return [m.weight for m in model.modules()
            if isinstance(m, Linear) and m.quantization is None and getattr(m, "weight", None) is not None
            and m.weight.dtype == torch.bfloat16 and m.weight.dim() == 2 and m.weight.is_contiguous()]


def _copies(w: torch.Tensor) -> tuple[bool, bool]:
    """(oneDNN's reordered copy, the tile-order copy): which `w` gets here. oneDNN's serves the rows the tile
    kernel leaves: all of them where no tile kernel takes w, those above `_AMX_ROWS` on AMX, none otherwise."""
    tiles = tile_kernel_fits(w)
    return not tiles or tile_kernel()[1] < _UNBOUNDED, tiles


def packed_bytes(model: nn.Module) -> int:
    """What `pack_linears_` would add: one or two copies of each distinct weight (see `_copies`)."""
    distinct = {w.data_ptr(): w for w in _packable(model) if w.data_ptr() not in _packed}
    return sum(w.numel() * w.element_size() * sum(_copies(w)) for w in distinct.values())


def pack_linears_(model: nn.Module) -> tuple[int, int]:
    """Packs every unquantized bf16 `Linear` weight of `model` once (a tied weight once): the tile-order copy
    where a tile kernel is built and takes the shape, oneDNN's reorder for the rows it leaves; returns
    (layers, bytes added)."""
    weights = _packable(model)
    added = 0
    for w in weights:
        if w.data_ptr() not in _packed:
            reorder, tiles = _copies(w)
            op, rows = tile_kernel() if tiles else (None, 0)
            register(w, torch.ops.mkldnn._reorder_linear_weight(w, _ROWS_HINT) if reorder else None,
                     pack_tiles(w) if tiles else None, op, rows)
            weakref.finalize(w, forget, w.data_ptr())
            added += w.numel() * w.element_size() * (reorder + tiles)
    return len(weights), added


def register(w: torch.Tensor, reordered: torch.Tensor | None, tiles: torch.Tensor | None, op: object,
             rows: int) -> None:
    """Makes `w`'s copies the ones its linears take: oneDNN's reordered copy, the tile copy for `op` up to
    `rows` rows (also registered with the C++ lookup where it is built)."""
    global _tile_rows_in_cpp
    _packed[w.data_ptr()] = (w.shape, reordered, tiles, op, rows)
    if tiles is not None and hasattr(torch.ops.vllm_neuron, "linear_tiles"):
        torch.ops.vllm_neuron.register_tile_copy(w, tiles, op.__name__, rows)
        _tile_rows_in_cpp = max(_tile_rows_in_cpp, rows)


def forget(address: int) -> None:
    """Drops the copies registered for the weight at `address`."""
    _packed.pop(address, None)
    if hasattr(torch.ops.vllm_neuron, "forget_tile_copy"):
        torch.ops.vllm_neuron.forget_tile_copy(address)


@functools.lru_cache(maxsize=1)
def tile_kernel_built() -> bool:
    """Whether this machine's kernel build has the AMX tile linear (an avx512bf16 build on an AMX CPU) and it
    runs: a kernel older than Linux 5.16 hands out no tile state, and the probe's error hands its rows on."""
    from vllm_neuron.model.layers import kernels

    if not (kernels.kernels_enabled(torch.device("cpu")) and hasattr(torch.ops.vllm_neuron, "linear_amx")):
        return False
    try:
        w = torch.ones(16, 32, dtype=torch.bfloat16)
        y = torch.ops.vllm_neuron.linear_amx(torch.ones(1, 32, dtype=torch.bfloat16), pack_tiles(w), None, 16)
    except RuntimeError as e:
        logger.warning("AMX tile linear unavailable (%s); the bf16 dot-product kernel or oneDNN serves its rows", e)
        return False
    return bool((y == 32).all())


_UNBOUNDED = 1 << 62


@functools.lru_cache(maxsize=1)
def dot_kernel_built() -> bool:
    """Whether this machine's kernel build has the VDPBF16PS tile-order linear (any avx512bf16 build)."""
    from vllm_neuron.model.layers import kernels

    return kernels.kernels_enabled(torch.device("cpu")) and hasattr(torch.ops.vllm_neuron, "linear_dot_tiles")


def tile_kernel() -> tuple[object, int] | None:
    """The kernel that takes tile-order copies here and the most rows it serves: AMX tiles up to `_AMX_ROWS`
    where they run, else VDPBF16PS dot products at every row count; None without either."""
    if tile_kernel_built():
        return torch.ops.vllm_neuron.linear_amx, _AMX_ROWS
    if dot_kernel_built():
        return torch.ops.vllm_neuron.linear_dot_tiles, _UNBOUNDED
    return None


def describe_copies() -> str:
    """Which copies serve which rows here, for the start-up log."""
    if tile_kernel_built():
        return f"AMX tile kernel up to {_AMX_ROWS} rows, oneDNN reordered above"
    if dot_kernel_built():
        return "bf16 dot-product kernel on tile-order copies"
    return "oneDNN reordered"


def tile_kernel_fits(w: torch.Tensor) -> bool:
    """Whether a tile kernel is built here and takes w's shape (N a multiple of 16, K of 32)."""
    return tile_kernel() is not None and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0


def pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] in the tile kernel's order: one B tile per 16 columns x 32 inputs, [N/16][K/32][16][16][2]."""
    n, k = w.shape
    return huge_pages.copy(w.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)).contiguous()


# A plain dispatcher kernel rather than torch.library.custom_op, whose wrapper cost ~25 us a call (121 calls a
# step on the bundled model: ~3 ms; measured 2026-12-03). A fragment: the C++ kernels define the namespace.
_lib = torch.library.Library("vllm_neuron", "FRAGMENT")
_lib.define("linear_prepacked(Tensor x, Tensor w, Tensor? bias) -> Tensor")
_linear_pointwise = torch.ops.mkldnn._linear_pointwise


_NO_COPIES = (None, None, None, None, 0)
# The most rows the tile copies registered with the C++ lookup serve (0: none registered).
_tile_rows_in_cpp = 0


def _linear_prepacked(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape, reordered, tiles, op, rows = _packed.get(w.data_ptr(), _NO_COPIES)
    if shape != w.shape:
        return F.linear(x, w, bias)
    if tiles is not None and x.shape[0] <= rows and (bias is None or bias.dtype == torch.bfloat16):
        return op(x, tiles, bias, shape[0])
    if reordered is not None:
        return _linear_pointwise(x, reordered, bias, "none", [], "")
    return F.linear(x, w, bias)


_lib.impl("linear_prepacked", _linear_prepacked, "CPU")


@torch.library.register_fake("vllm_neuron::linear_prepacked")
def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def linear_prepacked(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias) through w's packed copies when it has them. Where tile copies are
    registered with the C++ op and they serve x's rows (decided from shapes, when a graph is traced), the
    graph calls that op (kernels/linear_tile_copies.cpp), which looks the copy up without Python."""
    if 0 < x.shape[0] <= _tile_rows_in_cpp and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0:
        return torch.ops.vllm_neuron.linear_tiles(x, w, bias)
    return torch.ops.vllm_neuron.linear_prepacked(x, w, bias)
