"""Host memory in 2 MiB pages (Linux transparent huge pages) for the weights and their packed copies on CPU.

A decode step streams every weight once: in 4 KiB pages that is ~65,000 pages a step for the bundled model's
269 MB, a TLB miss on each and a stop for the hardware prefetchers at every page boundary. Most of these
machines run THP in `madvise` mode, so torch's allocations get 4 KiB pages; memory asked for with
MADV_HUGEPAGE gets 2 MiB ones. Measured on the Zen 5 EPYC VM (2026-12-04, in-process A/B): one step's linears
at 16 rows 8.04 instead of 8.80 ms (medians of 10 alternating rounds), at 1 row 7.26 instead of 7.42.

The KV pool goes to huge pages only with VLLM_NEURON_KV_HUGE_PAGES=1 (`kv_wanted`). Decode attention
reads every sequence's blocks in turn, and in 4 KiB pages a batch of 16 at a 1,500-token context stepped in
25.5-26.8 ms against 18.1-19.3 in 2 MiB ones (batch 4: 11.8 vs 9.4-10.3; P1 throughput 614 vs 661-687 tok/s;
Zen 5 EPYC VM, 2026-12-05). But the pool is backed while serving (worker/kv_prefault.py, whose sweeps know
the page size), and a fresh huge page is where the kernel compacts memory when it has no free 2 MiB run
(THP defrag `madvise`): one-at-a-time requests lost 20-30 ms of mean TTFT (P2 78-90 -> 96-113 ms, P3 warm
67-69 -> 99-102), so it stays off by default.
Weights from 64 KiB up share one mapping, side by side in the model's order (`Arena`, `move_parameters_`), and
so do the tile copies packed from them (linear.pack_linears_); norms and biases keep torch's allocator. Until
2026-12-06 only tensors of 4 MiB and more moved, each into a mapping of its own, and a decoder layer's linears
(0.6-3.5 MiB each in the bundled model) stayed in 4 KiB pages. Moving them too (2-core Zen 4 EPYC VM, in one
process, alternating): the 120 layer linears of one decode step by the weight-streaming kernel 6.94 -> 5.96 ms at
1 row and 6.31 -> 4.95 at 4; whole decode steps (medians of 8 alternating rounds) 9.80 -> 9.30 ms at batch 1,
11.05 -> 10.58 at 4, 18.85 -> 17.06 at 16 (the tile copies' share of that last one: 17.9 -> 16.6).
`VLLM_NEURON_HUGE_PAGES=0` turns all of this off; where the kernel has THP off (`never`) or no MADV_HUGEPAGE,
nothing changes.
"""
from __future__ import annotations

import functools
import mmap

import torch
from torch import nn

from vllm_neuron import envs

PAGE = 2 << 20
# Below this a tensor of its own keeps torch's allocator (its mapping would round up to whole huge pages).
MIN_BYTES = 4 << 20
# The model's weights share one mapping (move_parameters_) from this size on; norms and biases stay put.
ARENA_MIN_BYTES = 64 << 10
ARENA_ALIGN = 4096
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = _THP_ENABLED) -> str:
    """The kernel's THP mode: `always`, `madvise`, `never`, or "" where it has none (pure but for the read)."""
    try:
        text = open(path).read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether huge pages can be asked for here and are wanted (VLLM_NEURON_HUGE_PAGES, default on)."""
    return (envs.VLLM_NEURON_HUGE_PAGES and hasattr(mmap, "MADV_HUGEPAGE")
            and thp_mode() in ("always", "madvise"))


def wanted(nbytes: int, device: torch.device) -> bool:
    """Whether a CPU tensor of nbytes goes to huge pages."""
    return device.type == "cpu" and nbytes >= MIN_BYTES and available()


def kv_wanted(nbytes: int, device: torch.device) -> bool:
    """Whether a CPU KV pool tensor of nbytes goes to huge pages (VLLM_NEURON_KV_HUGE_PAGES)."""
    return envs.VLLM_NEURON_KV_HUGE_PAGES and wanted(nbytes, device)


def _mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """(a zeroed anonymous mapping asked for in huge pages, the offset of its first page boundary) with room
    for nbytes from that boundary on; backed on first touch."""
    m = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return m, -torch.frombuffer(m, dtype=torch.uint8, count=1).data_ptr() % PAGE


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in memory asked for in huge pages, its start on a page boundary (backed on first
    touch). The tensor keeps its mapping alive."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    m, start = _mapping(nbytes)
    # frombuffer holds m: the mapping lives as long as a tensor on it
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=start).view(dtype).view(shape)


def copy(t: torch.Tensor) -> torch.Tensor:
    """t's values in a contiguous huge-page tensor, or t itself where that does not apply."""
    if not wanted(t.numel() * t.element_size(), t.device):
        return t
    out = zeros(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


class Arena:
    """One huge-page mapping of `nbytes` that tensors are copied into side by side, each at a 4 KiB boundary
    (`place`): a decoder layer's weights are 0.6-3.5 MiB each in the bundled model, and a mapping of their own
    would round each up to whole 2 MiB pages. The mapping is backed as tensors are copied in, so a caller that
    drops each original as it goes never holds its tensors twice. Where huge pages do not apply, or once the
    mapping is full, `place` hands the tensor back as it was."""

    def __init__(self, nbytes: int):
        self._map, self._start = _mapping(nbytes) if nbytes > 0 and available() else (None, 0)
        self._size, self._used = nbytes, 0

    @staticmethod
    def footprint(t: torch.Tensor) -> int:
        """The bytes `t` takes in an arena, its alignment included."""
        return -(-t.numel() * t.element_size() // ARENA_ALIGN) * ARENA_ALIGN

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of t (any strides) in the arena, or t where it does not fit or applies."""
        if self._map is None or t.device.type != "cpu" or self._used + self.footprint(t) > self._size:
            return t
        # A storage of its own for each tensor, not a view of one arena tensor: torch.compile takes tensors on
        # one storage as aliases, and a layer's compiled region refuses aliased inputs (two weights of a layer).
        out = torch.frombuffer(self._map, dtype=torch.uint8, count=t.numel() * t.element_size(),
                               offset=self._start + self._used).view(t.dtype).view(t.shape)
        out.copy_(t)
        self._used += self.footprint(t)
        return out


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether t is its storage's only view, front to back: a view that shares its storage on purpose (a
    slice of a fused weight, a strided alias) must keep sharing it, so it stays where it is."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def move_parameters_(model: nn.Module) -> tuple[int, int]:
    """Moves the CPU parameters and buffers of `model` from ARENA_MIN_BYTES up into one `Arena` in place, in
    the model's own order (a tied weight once: `parameters()` yields each Parameter once; two tensors on one
    storage stay one); returns (tensors moved, bytes)."""
    distinct: dict[int, torch.Tensor] = {}
    picked = [t for t in [*model.parameters(), *model.buffers()]
              if t.device.type == "cpu" and t.numel() * t.element_size() >= ARENA_MIN_BYTES
              and _owns_storage(t.data)]
    for t in picked:
        distinct.setdefault(t.data_ptr(), t.data)
    if not distinct or not available():
        return 0, 0
    arena = Arena(sum(Arena.footprint(t) for t in distinct.values()))
    moved: dict[int, torch.Tensor] = {}
    for t in picked:
        ptr = t.data_ptr()
        if ptr not in moved:
            moved[ptr] = arena.place(t.data)
        t.data = moved[ptr]
    return len(moved), sum(m.numel() * m.element_size() for m in moved.values())
