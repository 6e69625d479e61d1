"""Wall time of every step the model runner executes, by bucket graph name (shared by the benchmarks).

Timing each step, not a whole request, lets a benchmark on a shared machine take a median: a step that
a load spike slowed moves it little."""
from __future__ import annotations

import statistics
import time
from collections import defaultdict


def time_steps(llm) -> dict[str, list[float]]:
    """Wraps the runner's execute so every step's wall time (seconds) lands under its bucket graph's name
    (e.g. `decode_b1`, `prefill_s256`) in the returned dict, which fills as the engine runs."""
    runner = llm.llm_engine.core.runner
    times: dict[str, list[float]] = defaultdict(list)
    execute = runner.execute

    def timed(sched):
        name = runner._step_bucket(sched)[2]
        t0 = time.perf_counter()
        out = execute(sched)
        times[name].append(time.perf_counter() - t0)
        return out

    runner.execute = timed
    return times


def steps_of(times: dict[str, list[float]], kind: str, size: int) -> list[float]:
    """Every recorded step of one bucket kind and size, whatever its context bucket (`decode_b1`,
    `decode_b1_c2048`, ...)."""
    from vllm_neuron.config.buckets import parse_bucket_name

    return [t for name, v in times.items() if parse_bucket_name(name)[:2] == (kind, size) for t in v]


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3 if values else float("nan")
