"""Backs the CPU KV pool's pages ahead of use, a chunk of blocks at a time, in block order.

The pool is mapped lazily (`runner_base._zeros`), so a multi-GiB cache costs nothing until used. But the
first write to a page is a fault, and on the VMs we run on a fault among never-touched pages costs ~100 us
(the hypervisor backs guest memory on first use), against ~4 us a page when a region is written in one
sweep. A decode step writes each new token into every layer's K and V tensors, one 4 KiB page every ~10
tokens of a sequence: a decode_b16 step of the bundled model (16 sequences, 60 K/V tensors) spent ~9.5 of
its ~28 ms in those faults (AMD EPYC VM, 2026-12-03), and prefill steps pay the same per page.

The block pool hands never-used blocks out in id order (and, told where this frontier stands, freed blocks
before never-used ones past it: core/block_pool.py), so a frontier in block ids is enough: before a step
whose newest block lies at or past the frontier, the blocks from the frontier on are swept, at least a chunk
of them. The sweep ORs one byte of every page with 0: every page is written, and a block that somehow holds
data already keeps it.

A sweep inside a step delays that step (64 MiB took 0.1-0.35 s here, 0.25 s on a slow afternoon), so the
step's chunk is small (8 MiB by default: 64 MiB ones put a quarter second into the first prefill of P3's cold
run, whose mean TTFT was 199-229 ms against 137-143 with 8 MiB, 2026-12-04), and an idle engine sweeps ahead
(`sweep_idle`, called once the engine has been idle a while, engine/core_proc.py), up to `idle_ahead_bytes`
(512 MiB) past the newest block seen. Its pieces are small (2 MiB): a request that arrives meanwhile waits for
the piece under way, and 16 MiB pieces added 50-80 ms to the mean TTFT of one-at-a-time requests (P2), 2 MiB
ones nothing measurable. An idle piece is one tensor's: the pool may lie in 2 MiB pages (huge_pages.py), and
a piece across every tensor would back a page of each, 60 x 2 MiB for the bundled model, in one go.

Pages are backed whole, so where they hold many blocks (`page_bytes`: 2 MiB huge pages against a ~12 KiB
block of one tensor) a sweep's end is rounded up to the next page's first block: the blocks up to there are
backed anyway, and the frontier moving to them saves the next steps from sweeping them again.
"""
from __future__ import annotations

import mmap
from collections.abc import Iterable

import torch

from vllm_neuron.logger import init_logger

logger = init_logger(__name__)


def next_sweep(frontier: int, newest: int, chunk: int, num_blocks: int) -> tuple[int, int] | None:
    """The blocks [start, end) to back before a step whose highest block id is `newest`, given that blocks
    below `frontier` are backed already (pure). None while newest stays below the frontier; otherwise from
    the frontier past `newest`, at least `chunk` blocks, never past num_blocks."""
    if newest < frontier or frontier >= num_blocks:
        return None
    end = min(num_blocks, max(newest + 1, frontier + chunk))
    return frontier, end


def touch_pages(t: torch.Tensor) -> None:
    """Writes one byte of every page a contiguous tensor's memory reaches, ORed with 0 (contents kept).
    Backing a page takes one write; writing every byte read and wrote the whole range besides (64 MiB:
    95 ms against 22 ms, 2-core EPYC VM, 2026-12-07). 4 KiB pages whatever the pool lies in: a huge page
    the kernel could not hand out falls back to small ones."""
    if t.numel() == 0:
        return
    flat = t.view(-1).view(torch.uint8)  # a view: a copy (of a strided tensor) would back nothing
    flat[:1].bitwise_or_(0)  # the page the range starts in, which may begin before it
    page = mmap.PAGESIZE
    flat[(-t.data_ptr()) % page::page].bitwise_or_(0)  # every page that begins inside the range


class KVPrefaulter:
    """Sweeps the pool's K/V tensors ([num_blocks * block_size + extra slots, heads, head_dim] each) ahead
    of the blocks the steps use. chunk_bytes is the least a sweep writes over all tensors together; an idle
    piece writes idle_piece_bytes of one tensor; page_bytes is the size of the pages the pool lies in."""

    def __init__(self, tensors: list[torch.Tensor], block_size: int, num_blocks: int, chunk_bytes: int,
                 idle_ahead_bytes: int = 512 << 20, idle_piece_bytes: int = 2 << 20,
                 page_bytes: int = mmap.PAGESIZE) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tensors = tensors
        self.bytes_per_block = sum(t[:block_size].nbytes for t in tensors)
        # The biggest tensors set the page's blocks: a smaller one (a draft model's) may lie in 4 KiB pages.
        tensor_block = max(1, max(t[:block_size].nbytes for t in tensors))
        self.page_blocks = max(1, page_bytes // tensor_block)  # blocks one page of a tensor holds
        self.chunk = max(1, chunk_bytes // max(1, self.bytes_per_block))
        self.frontier = 0  # blocks below it have been swept (sweeps are contiguous from block 0)
        self.newest_seen = -1
        self.idle_ahead = max(1, idle_ahead_bytes // max(1, self.bytes_per_block))
        self.idle_chunk = max(1, idle_piece_bytes // tensor_block)
        self._idle_tensor = 0  # tensors below it hold the next idle range already

    def before_step(self, block_tables: Iterable[list[int]]) -> None:
        """Backs the pages of every block the step's tables reach (each table's last block is its newest)."""
        if self.frontier >= self.num_blocks:
            return  # the whole pool is backed: nothing left to do on any later step
        newest = max((t[-1] for t in block_tables if t), default=-1)
        self.newest_seen = max(self.newest_seen, newest)
        sweep = next_sweep(self.frontier, newest, self.chunk, self.num_blocks)
        if sweep is not None:
            start, end = sweep[0], self._page_end(sweep[1])
            for t in self.tensors:
                self._touch(t, start, end)
            self._advance(end)

    def sweep_idle(self) -> bool:
        """One small sweep, of one tensor, while the engine has nothing to run; False once the frontier is far
        enough ahead of the newest block seen (or at the pool's end), so the caller may block until work
        arrives. The frontier moves once every tensor holds the piece's blocks."""
        if self.frontier >= min(self.num_blocks, self.newest_seen + 1 + self.idle_ahead):
            return False
        end = self._page_end(self.frontier + self.idle_chunk)
        self._touch(self.tensors[self._idle_tensor], self.frontier, end)
        self._idle_tensor += 1
        if self._idle_tensor == len(self.tensors):
            self._advance(end)
        return True

    @property
    def swept_bytes(self) -> int:
        return self.frontier * self.bytes_per_block

    def _page_end(self, end: int) -> int:
        """`end` moved up to the first block of a page (or the pool's end)."""
        return min(self.num_blocks, -(-end // self.page_blocks) * self.page_blocks)

    def _touch(self, t: torch.Tensor, start: int, end: int) -> None:
        touch_pages(t[start * self.block_size:end * self.block_size])

    def _advance(self, end: int) -> None:
        start, self.frontier, self._idle_tensor = self.frontier, end, 0
        logger.debug("KV pool: blocks %d-%d backed (%.0f MiB so far)", start, end - 1, self.swept_bytes / 2**20)
