"""Linears on copies of the bf16 weights packed once at load (AVX512-BF16 and AMX CPUs), for the rows the
weight-streaming kernel leaves.

`F.linear` on bf16 hands oneDNN a plain [N, K] weight, and on a Xeon with AMX oneDNN reorders it into its
tile layout on every call: at decode and small prefill sizes that reorder is most of the call. Reordered once
at load (what inductor's weight prepacking does under freezing, which our compile cache cannot take: it bakes
the weights into the graph), one decode step's linears of the bundled model took 27.7 instead of 37.8 ms at 16
rows, 40.3 instead of 62.7 at 64, 67.6 instead of 100.9 at 128 and 258 instead of 281 at 512 (2 threads,
2026-12-02).

Still, oneDNN read those weights at about half the memory bandwidth up to 32 rows, where a step's linears are
bound by that read. Up to `cpu_caps.AMX_ROWS` rows our tile kernel (kernels/linear_amx.cpp) streams a second copy
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

import weakref

import torch
import torch.nn.functional as F

from vllm_neuron import huge_pages
from vllm_neuron.model.layers.kernels import cpu_caps
from vllm_neuron.model.layers.kernels.ops import pack_tiles

# Rows the reorder is tuned for. Tuned for 128, the 512-row prefill took 305 ms instead of F.linear's 281; tuned
# for 512, 258 ms, with 64 rows unchanged (26 ms).
_ROWS_HINT = 512
# storage address -> (the plain weight's shape, oneDNN's reordered copy or None, the tile-order copy or None,
# the tile kernel and the most rows it serves); an entry leaves with its weight.
_packed: dict[int, tuple[torch.Size, torch.Tensor | None, torch.Tensor | None, object, int]] = {}


def copies_for(w: torch.Tensor) -> tuple[bool, bool]:
    """(oneDNN's reordered copy, the tile-order copy): which `w` gets here. oneDNN's serves the rows the tile
    kernel leaves: all of them where no tile kernel takes w, those above `cpu_caps.AMX_ROWS` on AMX, none
    otherwise."""
    tiles = tile_kernel_fits(w)
    return not tiles or cpu_caps.tile_kernel()[1] < cpu_caps.UNBOUNDED, tiles


def tile_bytes(weights: list[torch.Tensor]) -> int:
    """The arena `pack` needs for the tile copies of `weights` (distinct, not yet packed)."""
    return sum(huge_pages.Arena.footprint(w) for w in weights if not is_packed(w) and copies_for(w)[1])


def is_packed(w: torch.Tensor) -> bool:
    return w.data_ptr() in _packed


def pack(w: torch.Tensor, arena: huge_pages.Arena | None = None) -> int:
    """Packs `w`'s copies once (see `copies_for`) and registers them, the tile copy in `arena` where one is
    given (sized by `tile_bytes`); returns the bytes added."""
    if is_packed(w):
        return 0
    reorder, tiles = copies_for(w)
    op, rows = cpu_caps.tile_kernel() if tiles else (None, 0)
    register(w, torch.ops.mkldnn._reorder_linear_weight(w, _ROWS_HINT) if reorder else None,
             (pack_tiles(w, arena.place) if arena is not None else pack_tiles(w)) if tiles else None, op, rows)
    weakref.finalize(w, forget, w.data_ptr())
    return w.numel() * w.element_size() * (reorder + tiles)


def register(w: torch.Tensor, reordered: torch.Tensor | None, tiles: torch.Tensor | None, op: object,
             rows: int) -> None:
    """Makes `w`'s copies the ones its linears take: oneDNN's reordered copy, the tile copy for `op` up to
    `rows` rows (also registered with the C++ lookup where it is built)."""
    _packed[w.data_ptr()] = (w.shape, reordered, tiles, op, rows)
    if tiles is not None and hasattr(torch.ops.vllm_neuron, "linear_tiles"):
        torch.ops.vllm_neuron.register_tile_copy(w, tiles, op.__name__, rows)


def forget(address: int) -> None:
    """Drops the copies registered for the weight at `address`."""
    _packed.pop(address, None)
    if hasattr(torch.ops.vllm_neuron, "forget_tile_copy"):
        torch.ops.vllm_neuron.forget_tile_copy(address)


def tile_kernel_fits(w: torch.Tensor) -> bool:
    """Whether a tile kernel is built here and takes w's shape (N a multiple of 16, K of 32)."""
    return cpu_caps.tile_kernel() is not None and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0


# A plain dispatcher kernel rather than torch.library.custom_op, whose wrapper cost ~25 us a call (121 calls a
# step on the bundled model: ~3 ms; measured 2026-12-03). A fragment: the C++ kernels define the namespace.
_lib = torch.library.Library("vllm_neuron", "FRAGMENT")
_lib.define("linear_prepacked(Tensor x, Tensor w, Tensor? bias) -> Tensor")
_linear_pointwise = torch.ops.mkldnn._linear_pointwise
_NO_COPIES = (None, None, None, None, 0)


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


def linear_prepacked(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tile_rows: int) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias) through w's packed copies when it has them. Within `tile_rows` rows (the
    engine's KernelConfig.tile_rows: tile copies are registered with the C++ op and serve that many rows;
    decided from shapes, when a graph is traced) the graph calls that op (kernels/linear_tile_copies.cpp),
    which looks the copy up without Python and takes at::linear where there is none."""
    if 0 < x.shape[0] <= tile_rows and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0:
        return torch.ops.vllm_neuron.linear_tiles(x, w, bias)
    return torch.ops.vllm_neuron.linear_prepacked(x, w, bias)
