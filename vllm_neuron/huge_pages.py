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
Small tensors keep torch's allocator: a huge page would be mostly empty. `VLLM_NEURON_HUGE_PAGES=0` turns
this off; where the kernel has THP off (`never`) or no MADV_HUGEPAGE, nothing changes.
"""
from __future__ import annotations

import functools
import mmap

import torch
from torch import nn

from vllm_neuron import envs

PAGE = 2 << 20
# Below this a tensor keeps torch's allocator (its mapping would round up to whole huge pages).
MIN_BYTES = 4 << 20
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


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in memory asked for in huge pages, its start on a page boundary (backed on first
    touch). The tensor keeps its mapping alive."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    m = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(m, dtype=torch.uint8)  # holds m: the mapping lives as long as a view of it
    start = -raw.data_ptr() % PAGE
    return raw[start:start + nbytes].view(dtype).view(shape)


def copy(t: torch.Tensor) -> torch.Tensor:
    """t's values in a contiguous huge-page tensor, or t itself where that does not apply."""
    if not wanted(t.numel() * t.element_size(), t.device):
        return t
    out = zeros(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def move_parameters_(model: nn.Module) -> tuple[int, int]:
    """Moves every big CPU parameter and buffer of `model` into huge pages in place (a tied weight once:
    `parameters()` yields each Parameter once); returns (tensors moved, bytes)."""
    moved = nbytes = 0
    for t in [*model.parameters(), *model.buffers()]:
        data = t.data
        new = copy(data) if data.is_contiguous() else data  # a strided view may share its storage on purpose
        if new is not data:
            t.data = new
            moved += 1
            nbytes += new.numel() * new.element_size()
    return moved, nbytes
