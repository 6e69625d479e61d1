"""Disaggregated prefill/decode in the engine loop: the fixed points where EngineCore hands the scheduler's side
(core/kv_transfer.py) to the runner's (worker/kv_connector.py) and back.

* `before_schedule`: a prefill instance frees the blocks its readers are done with (or whose hold timed out)
  and stops serving them; a decode instance admits requests prefilled elsewhere, starts reading their blocks,
  and lets those whose reads ended prefill their last prompt token (or their whole prompt, after a failed
  read), telling each source it may free its blocks.
* `after_update`: the prompts a prefill instance just finished for remote readers are served from now on;
  their outputs carry the `kv_transfer_params` a reader needs (`params_of`).

Runner calls go through `call`, the engine's way of ordering them after steps still executing (async
scheduling, and tensor parallelism, whose ranks take one call at a time).
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm_neuron.config.kv_transfer import KVTransferConfig
from vllm_neuron.core.kv_transfer import KVTransferScheduler
from vllm_neuron.logger import init_logger
from vllm_neuron.worker.kv_connector import PENDING, READ

logger = init_logger(__name__)

RELEASE_POLL_S = 0.01  # how often a prefill instance looks for released blocks
IDLE_TICK_MS = 50  # an idle instance holding blocks wakes this often (releases, timeouts)


class KVTransferEngine:
    def __init__(self, cfg: KVTransferConfig, *, tp_size: int, block_size: int,
                 call: Callable[..., Any], clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.call, self.clock = cfg, call, clock
        self.scheduler_side = KVTransferScheduler(
            role=cfg.kv_role, engine_id=cfg.engine_id, host=cfg.host, port=cfg.kv_port, tp_size=tp_size,
            block_size=block_size, hold_timeout_s=cfg.hold_timeout_s, clock=clock)
        self._next_release_poll = 0.0
        self.transfers: list[tuple[bool, int, float]] = []  # (read, bytes, seconds) since the stats took them
        self.bytes_read = 0
        logger.info("Disaggregated prefill/decode: %s", cfg.describe())

    # -- the engine's fixed points -----------------------------------------------------------------------
    def before_schedule(self, scheduler) -> None:
        if self.cfg.is_producer:
            self._free_released(scheduler)
        if self.cfg.is_consumer:
            self._advance_loads(scheduler)

    def after_update(self) -> None:
        side = self.scheduler_side
        if side.new_holds:
            holds, side.new_holds = side.new_holds, []
            self.call("kv_hold", [(h.request.request_id, h.secret, h.groups) for h in holds])

    def params_of(self, req_id: str) -> dict | None:
        return self.scheduler_side.params_out.pop(req_id, None)

    @property
    def busy(self) -> bool:
        """Loads in flight: the engine has work even when no step can be scheduled."""
        return bool(self.scheduler_side.loading)

    def tick_ms(self) -> int | None:
        """How soon an idle engine should call before_schedule again (None: not before a request comes)."""
        return IDLE_TICK_MS if self.scheduler_side.held else None

    # -- a prefill instance ------------------------------------------------------------------------------
    def _free_released(self, scheduler) -> None:
        side = self.scheduler_side
        now = self.clock()
        if not side.held or now < self._next_release_poll:
            return
        self._next_release_poll = now + RELEASE_POLL_S
        freed = scheduler.release_held(self.call("kv_drain_released"))
        expired = scheduler.release_held(None)
        if expired:
            logger.warning("KV blocks of %d request(s) freed after %.0f s without a reader (hold_timeout_s): %s",
                           len(expired), self.cfg.hold_timeout_s, ", ".join(expired[:8]))
        if freed or expired:
            self.call("kv_forget", freed + expired)

    # -- a decode instance -------------------------------------------------------------------------------
    def _advance_loads(self, scheduler) -> None:
        side = self.scheduler_side
        if side.loading:
            ids = list(side.loading)
            states = self.call("kv_poll_loads", ids)
            done = [(rid, s) for rid, s in zip(ids, states) if s != PENDING]
            if done:
                jobs = [side.loading[rid] for rid, _ in done]
                for rid, state in done:
                    scheduler.finish_kv_load(rid, state == READ)
                self.call("kv_loads_done", jobs)
                results = self.call("kv_take_results")
                self.transfers.extend(results)
                self.bytes_read += sum(n for ok, n, _ in results if ok)
        jobs = scheduler.take_kv_loads()
        if jobs:
            self.call("kv_start_loads", jobs)

    def stats(self) -> tuple:
        """(held requests, held blocks, holds expired, loads, blocks read, recomputed, bytes read, new transfer
        results); the results are handed over once."""
        s = self.scheduler_side.stats
        new, self.transfers = self.transfers, []
        return (s.held_requests, s.held_blocks, s.expired, s.loads, s.loaded_blocks, s.recomputed, self.bytes_read,
                new)
