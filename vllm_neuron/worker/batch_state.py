"""Model Runner V2's device-resident per-request state, one slot per running request.

The state lives in device tensors of `max_num_seqs + 1` slots; the last slot is a dummy that padding
rows point to (null block table -> block 0, position 0, greedy), so a padded row writes only there.
The host side only tracks which request owns which slot and which block-table entries it already
wrote, so a step sends joins, leaves and new blocks, never the whole batch.

Each slot holds its request's 32-bit sampling seed; the graph draws `counter_uniform(seed, position)`
(model/layers/in_graph_sampler.py), the same number the host sampler and MRv1 use for that token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_neuron.worker.step_inputs import SlotState


@dataclass
class SlotParams:
    """In-graph sampling parameters of one slot (temperature 0 = greedy, also for host-sampled rows)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


class BatchState:
    """Device tensors indexed by slot, and the host bookkeeping that keeps them current."""

    def __init__(self, max_num_seqs: int, max_blocks: int, device: torch.device, num_kv_groups: int = 1,
                 extras: dict[str, torch.dtype] | None = None) -> None:
        """extras: a model kind's per-slot inputs (name -> dtype), zero for the dummy slot."""
        self.num_slots = max_num_seqs + 1
        self.dummy = max_num_seqs
        self.max_blocks = max_blocks
        self.device = device
        n = self.num_slots
        self.last_token = torch.zeros(n, dtype=torch.int64, device=device)
        self.position = torch.zeros(n, dtype=torch.int64, device=device)  # of last_token, i.e. the next fed
        self.block_table = torch.zeros((n, max_blocks), dtype=torch.int64, device=device)
        # KV cache groups 1.. (kv_cache_groups.py): their own block tables, indexed like block_table.
        self.group_tables = [torch.zeros((n, max_blocks), dtype=torch.int64, device=device)
                             for _ in range(num_kv_groups - 1)]
        self.temperature = torch.zeros(n, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(n, dtype=torch.int64, device=device)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.seed = torch.zeros(n, dtype=torch.int64, device=device)
        self.extras = {name: torch.zeros(n, dtype=dt, device=device) for name, dt in (extras or {}).items()}
        self.state = SlotState(self.last_token, self.position, self.block_table, self.temperature, self.top_k,
                               self.top_p, self.seed, tuple(self.group_tables), self.extras)
        self._free = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out low slots first
        self._slots: dict[str, int] = {}
        self._written: dict[tuple[str, int], list[int]] = {}  # (request, group) -> ids already in its device row
        self._version = 0  # bumps on every join/leave: cached row->slot maps go stale
        self._rows_key: tuple | None = None
        self._rows: torch.Tensor | None = None

    # -- joins and leaves -------------------------------------------------------------------------
    def has(self, req_id: str) -> bool:
        return req_id in self._slots

    def slot(self, req_id: str) -> int:
        return self._slots[req_id]

    @property
    def num_active(self) -> int:
        return len(self._slots)

    def join(self, req_id: str, params: SlotParams, extras: dict[str, float | int] | None = None) -> int:
        if req_id in self._slots:
            raise ValueError(f"request {req_id!r} already holds slot {self._slots[req_id]}")
        if not self._free:
            raise RuntimeError(f"Model Runner V2: no free batch slot for request {req_id!r}; all "
                               f"{self.num_slots - 1} slots (max_num_seqs) are held by {sorted(self._slots)}")
        s = self._free.pop()
        self._slots[req_id] = s
        for g in range(1 + len(self.group_tables)):
            self._written[(req_id, g)] = []
        self._version += 1
        # One small write per parameter; joins are rare next to steps.
        self.temperature[s] = params.temperature
        self.top_k[s] = params.top_k
        self.top_p[s] = params.top_p
        self.seed[s] = params.seed
        self.last_token[s] = 0
        self.position[s] = 0
        self.block_table[s].zero_()
        for t in self.group_tables:
            t[s].zero_()
        for name, t in self.extras.items():
            t[s] = (extras or {}).get(name, 0)
        return s

    def leave(self, req_id: str) -> None:
        """Frees the request's slot (finished or preempted); unknown ids are ignored."""
        s = self._slots.pop(req_id, None)
        if s is None:
            return
        for g in range(1 + len(self.group_tables)):
            self._written.pop((req_id, g), None)
        self._free.append(s)
        self._version += 1

    # -- per-step host -> device updates --------------------------------------------------------
    def sync_block_tables(self, tables: list[tuple[str, list[int]]], group: int = 0) -> int:
        """Writes the block-table entries (of KV cache group `group`) the device does not have yet (one
        scatter for the whole step). Tables only grow while a request holds its slot; a table that changed
        under the written prefix is rewritten whole. A sliding-window group's given-back entries (null in
        the host table) may stay stale here: attention never reads before the window. Returns the number
        of entries written."""
        slots, cols, blocks = [], [], []
        for req_id, block_ids in tables:
            done = self._written[(req_id, group)]
            n = len(done)
            ids = block_ids[:self.max_blocks]  # columns past max_model_len can never be addressed
            if len(ids) == n and (n == 0 or ids[-1] == done[-1]):
                continue
            if n and (len(ids) < n or ids[n - 1] != done[n - 1]):
                n = 0
            s = self._slots[req_id]
            for c in range(n, len(ids)):
                slots.append(s)
                cols.append(c)
                blocks.append(ids[c])
            self._written[(req_id, group)] = list(ids)
        if slots:
            idx = torch.tensor([slots, cols], dtype=torch.int64).to(self.device)
            table = self.block_table if group == 0 else self.group_tables[group - 1]
            table.index_put_((idx[0], idx[1]), torch.tensor(blocks, dtype=torch.int64).to(self.device))
        return len(slots)

    def set_last_tokens(self, req_ids: list[str], tokens: list[int]) -> None:
        """Overwrites the last sampled token (rows the host sampled after the graph ran)."""
        if not req_ids:
            return
        idx = torch.tensor([self._slots[r] for r in req_ids], dtype=torch.int64).to(self.device)
        self.last_token.index_copy_(0, idx, torch.tensor(tokens, dtype=torch.int64).to(self.device))

    def row_slots(self, req_ids: list[str | None], rows: int) -> torch.Tensor:
        """[rows] slot of each row (None and padding rows -> the dummy slot). Rebuilt only when the
        batch's request list or the slot assignment changed since the last call."""
        key = (self._version, rows, tuple(req_ids))
        if key != self._rows_key:
            out = [self.dummy] * rows
            for i, rid in enumerate(req_ids):
                if rid is not None:
                    out[i] = self._slots[rid]
            self._rows = torch.tensor(out, dtype=torch.int64).to(self.device)
            self._rows_key = key
        return self._rows
