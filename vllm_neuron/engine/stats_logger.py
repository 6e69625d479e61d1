"""vLLM's periodic engine stats line, logged by the EngineCore process every VLLM_LOG_STATS_INTERVAL s.

"Engine 000: Avg prompt throughput: 310.2 tokens/s, Avg generation throughput: 45.1 tokens/s,
Running: 4 reqs, Waiting: 0 reqs, GPU KV cache usage: 3.1%, Prefix cache hit rate: 42.0%" - vLLM's
words (its CPU backend also says "GPU"), so log scrapers written for vLLM read ours. As in vLLM, an
idle engine (no tokens in this interval nor in the last) logs at debug level only. The prefix-cache
hit rate counts tokens since start-up. `--disable-log-stats` turns the line off.
"""
from __future__ import annotations

import logging

from vllm_neuron.engine.messages import EngineCoreOutputs, SchedulerStats
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)


class StatsLogger:
    def __init__(self, interval_s: float, now: float, engine_index: int = 0) -> None:
        self.interval_s = interval_s
        self.engine_index = engine_index
        self.last_log = now
        self.prompt_tokens = self.generation_tokens = 0
        self.last_throughput = (0.0, 0.0)
        self.stats: SchedulerStats | None = None

    def record(self, outs: EngineCoreOutputs) -> None:
        s = outs.stats
        if s is not None:
            self.stats = s
            if s.step_kind == "prefill":
                self.prompt_tokens += s.num_tokens
        self.generation_tokens += sum(len(o.new_token_ids) for o in outs.outputs)

    def seconds_to_next(self, now: float) -> float:
        return max(0.0, self.last_log + self.interval_s - now)

    def line(self, now: float) -> tuple[int, str, tuple] | None:
        """(level, format, args) of the line due at `now`, resetting the interval; None if not due."""
        elapsed = now - self.last_log
        if elapsed < self.interval_s:
            return None
        throughput = (self.prompt_tokens / elapsed, self.generation_tokens / elapsed)
        idle = not any(throughput + self.last_throughput)
        self.last_throughput, self.last_log = throughput, now
        self.prompt_tokens = self.generation_tokens = 0
        s = self.stats or SchedulerStats()
        hit_rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
        return (logging.DEBUG if idle else logging.INFO,
                "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                (self.engine_index, *throughput, s.num_running, s.num_waiting, s.kv_cache_usage * 100,
                 hit_rate * 100))

    def maybe_log(self, now: float) -> None:
        due = self.line(now)
        if due is not None:
            level, fmt, args = due
            logger.log(level, fmt, *args)
