"""What a runner step spends its time on: the step's wall time, its bucket graphs' time, and (while a
profiler runs) the host phases around the graphs as trace ranges.

`@timed_step` wraps a runner's `execute`; `StepClock.timed(graph)` wraps each bucket graph (runner_base's
`_graph`); `ProfiledRunner` gives the runners start_profile / stop_profile. While a profiler runs the step is one "execute" range cut into "build_inputs" (up to the first
graph), one "graph" range per graph call around its "bucket:<name>" range, and "sample" (after the graph:
host sampling, the state update, drafts) - consecutive ranges, so their durations add up to the step's.
All of it sits outside the compiled graphs. Without a profiler the cost is two perf_counter reads per graph
and per step (VLLM_NEURON_STEP_TIMING=0: none); the results go into the step's ModelRunnerOutput.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from torch.profiler import record_function

from vllm_neuron import envs, profiler
from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)


class StepClock:
    """One runner's timing state, and its process profiler (profiler.TraceSession)."""

    def __init__(self) -> None:
        self.enabled = envs.VLLM_NEURON_STEP_TIMING
        self.graph_s = 0.0  # the step in progress: its graphs' time so far
        self.trace = profiler.TraceSession()
        self._host: record_function | None = None  # the open host-phase range
        self._wrapped: dict[int, TimedGraph] = {}

    def timed(self, graph: Callable) -> "TimedGraph":
        """`graph` (a bucket's BucketGraph or ReplayedGraph, which carry .name), timed; one wrapper per graph."""
        t = self._wrapped.get(id(graph))
        if t is None or t.fn is not graph:
            t = self._wrapped[id(graph)] = TimedGraph(graph, self)
        return t

    def open_phase(self, name: str) -> None:
        self.close_phase()
        r = record_function(name)
        r.__enter__()
        self._host = r

    def close_phase(self) -> None:
        if self._host is not None:
            r, self._host = self._host, None
            r.__exit__(None, None, None)


class TimedGraph:
    def __init__(self, fn: Callable, clock: StepClock) -> None:
        self.fn = fn
        self.clock = clock
        self.name = fn.name
        self._range = profiler.BUCKET_PREFIX + fn.name

    def __call__(self, x: Any) -> Any:
        clock = self.clock
        if not profiler.active():
            return self._run(x)
        clock.close_phase()  # the host phase before the graph ends where it starts
        with record_function("graph"), record_function(self._range):
            out = self._run(x)
        clock.open_phase("sample")
        return out

    def _run(self, x: Any) -> Any:
        if not self.clock.enabled:
            return self.fn(x)
        t0 = time.perf_counter()
        out = self.fn(x)
        self.clock.graph_s += time.perf_counter() - t0
        return out


def timed_step(execute: Callable) -> Callable:
    """Decorates a runner's execute(sched): the ModelRunnerOutput carries execute_seconds and graph_seconds."""
    @functools.wraps(execute)
    def run(self, sched):
        clock: StepClock = self.step_clock
        clock.graph_s = 0.0
        if profiler.active():
            with record_function("execute"):
                clock.open_phase("build_inputs")
                t0 = time.perf_counter()
                try:
                    out = execute(self, sched)
                finally:
                    clock.close_phase()
        elif clock.enabled:
            t0 = time.perf_counter()
            out = execute(self, sched)
            clock.close_phase()  # a profiler started during this step opened one
        else:
            return execute(self, sched)
        if clock.enabled:
            out.execute_seconds = time.perf_counter() - t0
            out.graph_seconds = clock.graph_s
        return out
    return run


class ProfiledRunner:
    """The runner's profiling calls; a TP executor runs them on every rank, each writing its own process' trace."""

    step_clock: StepClock

    def start_profile(self, role: str, tag: str) -> None:
        self.step_clock.trace.start(f"{role}_rank{ps.info().rank}", tag)

    def stop_profile(self) -> int:
        """1 once this rank's trace is written, 0 if it could not be (a TP executor takes the minimum over the
        ranks, so it returns once every rank is done); never raises, as the other ranks wait on the result."""
        try:
            self.step_clock.trace.stop()
            return 1
        except Exception as e:  # noqa: BLE001
            logger.warning("rank %d: the profile could not be written: %s", ps.info().rank, e)
            return 0
