"""The periodic engine stats line (vLLM's format, idle intervals at debug level)."""
from __future__ import annotations

import logging

from vllm_neuron.engine.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from vllm_neuron.engine.stats_logger import StatsLogger


def _step(kind: str, tokens: int, outputs: int, **stats) -> EngineCoreOutputs:
    s = SchedulerStats(step_kind=kind, num_tokens=tokens, **stats)
    return EngineCoreOutputs([EngineCoreOutput(f"r{i}", [7]) for i in range(outputs)], s)


def test_line_every_interval_with_vllms_fields():
    log = StatsLogger(10.0, now=0.0)
    log.record(_step("prefill", 300, 2, num_running=2, kv_cache_usage=0.031, prefix_queries=300, prefix_hits=100))
    log.record(_step("decode", 2, 2, num_running=2, num_waiting=1, kv_cache_usage=0.032, prefix_queries=300,
                     prefix_hits=100))
    assert log.line(9.9) is None
    level, fmt, args = log.line(10.0)
    text = fmt % args
    assert level == logging.INFO
    assert text == ("Engine 000: Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 0.4 tokens/s, "
                    "Running: 2 reqs, Waiting: 1 reqs, GPU KV cache usage: 3.2%, Prefix cache hit rate: 33.3%")
    # The interval after the work still logs (its zeros say the work stopped); the next idle one is debug.
    assert log.line(20.0)[0] == logging.INFO
    assert log.line(30.0)[0] == logging.DEBUG
