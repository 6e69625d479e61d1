"""Admission control: a bound on the engine requests the API server has admitted and not finished
(running and waiting; a request with n > 1 or several prompts counts each), vLLM's `--max-num-queued-reqs`.

The API server reserves a request's room before it does any work for it (template rendering,
tokenization, media, grammar compilation) and gives it back when the request ends: finished, failed, or
abandoned by its client (a client that times out and disconnects frees its place at once). Beyond the
bound a request is refused with EngineOverloadedError (a 503 with Retry-After) and never reaches an engine
core, so a saturated server answers at once instead of queueing without end. Why here and not in the
engine core's scheduler: a refusal there would come after the API server had rendered and tokenized the
request and a stream had started; the API server also sees the data-parallel replicas together.

Retry-After is the time one admitted request has taken to finish lately (at least 1 s, at most 60 s).
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from vllm_neuron.engine.protocol import AdmissionTicket, EngineOverloadedError

_RECENT = 32  # finished requests the Retry-After estimate looks at
MAX_RETRY_AFTER_S = 60


class _Ticket(AdmissionTicket):
    def __init__(self, control: AdmissionControl, weight: int) -> None:
        self._control = control
        self._weight = weight
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._control._release(self._weight)

    def __del__(self) -> None:
        # A streaming response whose body never started (its client left first) drops its ticket unreleased.
        try:
            self.release()
        except Exception:  # noqa: BLE001 - at interpreter exit the metrics may be gone; nothing is waiting then
            pass


class AdmissionControl:
    """`limit` engine requests at most (0: no bound). `on_change(admitted, rejected_reason)` is called after
    every change (metrics)."""

    def __init__(self, limit: int, on_change: Callable[[int, str | None], None] | None = None) -> None:
        if limit < 0:
            raise ValueError(f"max_num_queued_reqs must be >= 0 (0: no bound), got {limit}")
        self.limit = limit
        self._on_change = on_change
        self._lock = threading.Lock()
        self._admitted = 0
        self._finished: deque[float] = deque(maxlen=_RECENT)
        self.rejected = 0

    @property
    def admitted(self) -> int:
        return self._admitted

    def admit(self, weight: int) -> AdmissionTicket:
        """A ticket for `weight` engine requests; EngineOverloadedError when they do not fit now, ValueError
        when they never would."""
        if self.limit and weight > self.limit:
            raise ValueError(f"this request asks for {weight} completions (n x prompts), more than the server "
                             f"ever runs or queues at once ({self.limit}, --max-num-queued-reqs)")
        with self._lock:
            refused = bool(self.limit) and self._admitted + weight > self.limit
            if refused:
                self.rejected += 1
                retry = self._retry_after()
            else:
                self._admitted += weight
            admitted = self._admitted
            self._changed("queue_full" if refused else None)
        if refused:
            raise EngineOverloadedError(
                f"The server is saturated: {admitted} requests are running or waiting, the most it takes "
                f"(--max-num-queued-reqs {self.limit}). Retry after {retry} s.", retry_after_s=retry)
        return _Ticket(self, weight)

    def _release(self, weight: int) -> None:
        with self._lock:
            self._admitted -= weight
            self._finished.append(time.monotonic())
            self._changed(None)

    def _changed(self, rejected_reason: str | None) -> None:
        """(under self._lock, so that the reported counts come in order)"""
        if self._on_change is not None:
            self._on_change(self._admitted, rejected_reason)

    def _retry_after(self) -> int:
        """Seconds until a place is likely free: the mean time between recent finishes (under self._lock)."""
        if len(self._finished) < 2:
            return 1
        span = time.monotonic() - self._finished[0]
        per_finish = span / len(self._finished)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(per_finish)))
