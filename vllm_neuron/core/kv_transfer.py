"""The scheduler's side of disaggregated prefill/decode (no tensors): which blocks a prefill instance holds for
a decode instance, and which blocks a decode instance reads instead of computing them.

Prefill instance (kv_producer): a request whose `kv_transfer_params` say `do_remote_decode` finishes its one
token as usual, but its blocks are held, not freed, until the reader says it is done or `hold_timeout_s`
passes (freed then, and counted). Its output carries vLLM's `kv_transfer_params` for the decode instance: this
instance's engine id, host and port, the request's block ids, tensor-parallel size, and a secret (ours: the
reader must name it, so block ids alone never open another request's KV).

Decode instance (kv_consumer): a request whose params say `do_remote_prefill` (with a source) gets its prompt's
blocks allocated as a prefill would, minus a local prefix-cache hit; the blocks holding its prompt tokens but
the last are read from the source (`KVLoadJob`), then the last prompt token is prefilled here, which gives the
first token's logits. A transfer that fails (source gone, refused, timed out) leaves the request to prefill
locally from its cached prefix: the answer is the same, only slower (counted).
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_neuron.core.request import Request
from vllm_neuron.step import KVLoadJob


@dataclass
class HeldBlocks:
    request: Request
    secret: str
    groups: list[list[int]]
    deadline: float


@dataclass
class KVTransferStats:
    """Cumulative, but for the held gauges."""

    held_requests: int = 0
    held_blocks: int = 0
    expired: int = 0  # holds freed by the timeout (no reader came)
    loads: int = 0
    loaded_blocks: int = 0
    recomputed: int = 0  # remote prefills that fell back to a local prefill


class KVTransferScheduler:
    def __init__(self, *, role: str, engine_id: str, host: str, port: int, tp_size: int, block_size: int,
                 hold_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.role, self.engine_id, self.host, self.port = role, engine_id, host, port
        self.tp_size, self.block_size, self.hold_timeout_s = tp_size, block_size, hold_timeout_s
        self.clock = clock
        self.held: dict[str, HeldBlocks] = {}
        self.new_holds: list[HeldBlocks] = []  # for the runner's block servers, taken by the engine
        self.params_out: dict[str, dict] = {}  # request id -> kv_transfer_params of its output
        self.loading: dict[str, KVLoadJob] = {}
        self._orphans: dict[str, list[list[int]]] = {}  # aborted while loading: freed when the load ends
        self._attempted: set[str] = set()  # a remote prefill is tried once (not again after a preemption)
        self.stats = KVTransferStats()

    @staticmethod
    def params(req: Request) -> dict:
        extra = req.sampling_params.extra_args or {}
        return extra.get("kv_transfer_params") or {}

    # -- prefill instance ---------------------------------------------------------------------------------
    def wants_hold(self, req: Request, reason: str) -> bool:
        """A finished request whose reader will come: its prompt was prefilled here for another instance."""
        return self.role in ("kv_producer", "kv_both") and bool(self.params(req).get("do_remote_decode")) \
            and reason in ("length", "stop")

    def hold(self, req: Request, groups: list[list[int]]) -> None:
        """Holds `req`'s blocks; its output's kv_transfer_params tell the reader where they are."""
        held = HeldBlocks(req, secrets.token_hex(16), [list(g) for g in groups], self.clock() + self.hold_timeout_s)
        self.held[req.request_id] = held
        self.new_holds.append(held)
        self._count_held()
        self.params_out[req.request_id] = {
            "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": self.engine_id,
            "remote_request_id": req.request_id, "remote_host": self.host, "remote_port": self.port,
            "remote_block_ids": groups[0] if len(groups) == 1 else groups, "tp_size": self.tp_size,
            "remote_num_tokens": req.num_prompt_tokens, "remote_secret": held.secret}

    def take_expired(self) -> list[HeldBlocks]:
        now = self.clock()
        gone = [h for h in self.held.values() if h.deadline <= now]
        self.stats.expired += len(gone)
        return self._drop([h.request.request_id for h in gone])

    def take_released(self, req_ids: list[str]) -> list[HeldBlocks]:
        return self._drop(req_ids)

    def _drop(self, req_ids: list[str]) -> list[HeldBlocks]:
        out = [self.held.pop(r) for r in req_ids if r in self.held]
        self._count_held()
        return out

    def _count_held(self) -> None:
        self.stats.held_requests = len(self.held)
        self.stats.held_blocks = sum(len(set(g)) for h in self.held.values() for g in h.groups)

    # -- decode instance ------------------------------------------------------------------------------------
    def remote_source(self, req: Request) -> dict | None:
        """The params of a request whose prompt was prefilled elsewhere and is not read yet (None: prefill it
        here)."""
        p = self.params(req)
        if self.role not in ("kv_consumer", "kv_both") or not p.get("do_remote_prefill") or \
                req.request_id in self._attempted:
            return None
        if not all(p.get(k) is not None for k in ("remote_host", "remote_port", "remote_block_ids",
                                                   "remote_request_id")):
            return None
        return p

    def load_job(self, req: Request, params: dict, first_block: int, local_tables: list[list[int]]) -> KVLoadJob | None:
        """The blocks to read for `req`: those holding its prompt tokens but the last, from `first_block` on
        (a local prefix-cache hit covers the ones before); None when there is nothing to read or the source's
        block list cannot cover it (the request then prefills here)."""
        self._attempted.add(req.request_id)
        n_load = req.num_prompt_tokens - 1
        n_blocks = -(-n_load // self.block_size)
        remote = params["remote_block_ids"]
        remote_groups = remote if remote and isinstance(remote[0], list) else [remote]
        remote_tokens = params.get("remote_num_tokens")
        if n_blocks <= first_block or len(remote_groups) != len(local_tables) or \
                any(len(g) < n_blocks for g in remote_groups) or any(len(t) < n_blocks for t in local_tables) or \
                (remote_tokens is not None and remote_tokens < n_load):
            if n_blocks > first_block:
                self.stats.recomputed += 1
            return None
        groups = [(list(r[first_block:n_blocks]), list(t[first_block:n_blocks]))
                  for r, t in zip(remote_groups, local_tables)]
        job = KVLoadJob(req.request_id, params["remote_host"], params["remote_port"], params.get("tp_size") or 1,
                        params["remote_request_id"], params.get("remote_secret") or "", groups, num_tokens=n_load,
                        engine_id=params.get("remote_engine_id") or "")
        self.loading[req.request_id] = job
        return job

    def is_loading(self, req_id: str) -> bool:
        return req_id in self.loading

    def orphan(self, req_id: str, tables: list[list[int]]) -> None:
        self._orphans[req_id] = tables

    def finish_load(self, req_id: str, ok: bool) -> list[list[int]] | None:
        """Records a load's end; the tables of a request aborted meanwhile, to free now."""
        job = self.loading.pop(req_id, None)
        if ok and job is not None:
            self.stats.loads += 1
            self.stats.loaded_blocks += len(job.groups[0][1])
        elif job is not None:
            self.stats.recomputed += 1
        return self._orphans.pop(req_id, None)

    def forget(self, req_id: str) -> None:
        """The request ended here (its hold, if any, lives on)."""
        self._attempted.discard(req_id)
