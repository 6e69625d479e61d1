"""The scheduler's side of the second KV tier (config/kv_offload.py; no tensors): which blocks the tier holds,
which to write there, and which requests are reading blocks back.

A block is in the tier when every tensor-parallel rank's file of it exists (the files are the index, so a
restarted engine and the other replicas sharing the folder see the same). A request being admitted whose
prompt continues past its local prefix hit with blocks in the tier gets blocks for them and a `TierLoadJob`;
it prefills nothing until the load ends, then starts after the loaded blocks (or, after a failed load, from its
local hit or the last block read: the same answer, later). Every full block the prefix cache registers is written once.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from vllm_neuron.config.kv_offload import block_file
from vllm_neuron.step import TierLoadJob


@dataclass
class KVTierStats:
    """Cumulative."""

    loads: int = 0
    loaded_blocks: int = 0
    failed_loads: int = 0  # a file was missing, torn or foreign: the blocks from there on were prefilled instead
    stored_blocks: int = 0  # blocks handed to the writers


class KVTierScheduler:
    def __init__(self, folder: str, tp_size: int) -> None:
        self.folder, self.tp_size = folder, tp_size
        self.loading: dict[str, TierLoadJob] = {}
        self.new_loads: list[TierLoadJob] = []  # for the runner, taken by the engine
        self.stores: list[tuple[int, bytes]] = []  # (block id, hash), taken by the engine
        self._orphans: dict[str, list[list[int]]] = {}  # aborted while loading: freed when the load ends
        self.stats = KVTierStats()

    def has(self, block_hash: bytes) -> bool:
        return all(os.path.exists(block_file(self.folder, block_hash, r)) for r in range(self.tp_size))

    def extension(self, hashes: list[bytes], first: int) -> list[bytes]:
        """The tier's blocks continuing a local hit of `first` blocks, in order, up to its first miss."""
        out = []
        for h in hashes[first:]:
            if not self.has(h):
                break
            out.append(h)
        return out

    def start_load(self, req_id: str, hashes: list[bytes], blocks: list[int]) -> None:
        job = TierLoadJob(req_id, list(hashes), list(blocks))
        self.loading[req_id] = job
        self.new_loads.append(job)

    def is_loading(self, req_id: str) -> bool:
        return req_id in self.loading

    def orphan(self, req_id: str, tables: list[list[int]]) -> None:
        self._orphans[req_id] = tables

    def finish_load(self, req_id: str, read: int) -> tuple[int, list[list[int]] | None]:
        """Records a load's end, `read` blocks from the first on: (blocks read, the tables of a request aborted
        meanwhile, to free now)."""
        job = self.loading.pop(req_id, None)
        n = min(read, len(job.blocks)) if job is not None else 0
        if job is not None:
            self.stats.loads += 1
            self.stats.loaded_blocks += n
            self.stats.failed_loads += n < len(job.blocks)
        return n, self._orphans.pop(req_id, None)

    def cached(self, blocks: list[tuple[int, bytes]]) -> None:
        """Blocks the prefix cache just registered: those not in the tier yet are written."""
        new = [(b, h) for b, h in blocks if not self.has(h)]
        self.stores.extend(new)
        self.stats.stored_blocks += len(new)

    def take(self) -> tuple[list[TierLoadJob], list[tuple[int, bytes]]]:
        loads, stores = self.new_loads, self.stores
        self.new_loads, self.stores = [], []
        return loads, stores
