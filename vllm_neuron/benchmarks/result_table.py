"""Metrics of a finished benchmark and vLLM's "Serving Benchmark Result" table.

The table's labels, widths and order follow vLLM's `vllm bench serve` line for line, so the
output of the two tools can be compared with diff. Result keys are vLLM's too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_neuron.benchmarks.endpoint_request import RequestOutput

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
# (short name, section header) per metric, in vLLM's print order.
_METRIC_LABELS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
_TITLE = " Serving Benchmark Result "
_WIDTH = 50


@dataclass
class MetricStats:
    """Milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    stats: dict[str, MetricStats] = field(default_factory=dict)
    output_lens: list[int] = field(default_factory=list)


def _stats(values_s: list[float], percentiles: list[float]) -> MetricStats:
    # An empty list (every request failed) reports zeros rather than NaN, as vLLM does.
    arr = np.asarray(values_s if values_s else [0.0], dtype=np.float64) * 1000.0
    return MetricStats(mean=float(arr.mean()), median=float(np.median(arr)),
                       std=float(arr.std()),
                       percentiles=[(p, float(np.percentile(arr, p))) for p in percentiles])


def count_output_tokens(out: RequestOutput, tokenizer: Any) -> int:
    """The server's usage count when it sent one, else the generated text re-tokenized."""
    if out.output_tokens:
        return out.output_tokens
    if tokenizer is not None:
        return len(tokenizer.encode(out.generated_text, add_special_tokens=False))
    return len(out.chunk_times)


def _peak_tokens_per_s(outputs: list[RequestOutput], t0: float) -> float:
    """Most content chunks received in any one-second window counted from the first send."""
    buckets: dict[int, int] = {}
    for out in outputs:
        for t in out.chunk_times:
            sec = int(t - t0)
            buckets[sec] = buckets.get(sec, 0) + 1
    return float(max(buckets.values())) if buckets else 0.0


def _peak_concurrency(outputs: list[RequestOutput]) -> int:
    """Largest number of requests in flight at once, over half-open [start, end) intervals."""
    events = []
    for out in outputs:
        events.append((out.start_time, 1))
        events.append((out.start_time + out.latency, -1))
    # An end at the same instant as a start is processed first: the two never overlapped.
    events.sort()
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def compute_metrics(outputs: list[RequestOutput], duration_s: float, tokenizer: Any,
                    percentiles: list[float]) -> BenchmarkMetrics:
    """Aggregate per-request timings. TPOT = (E2EL - TTFT) / (output tokens - 1), out > 1."""
    ok = [o for o in outputs if o.success]
    output_lens = [count_output_tokens(o, tokenizer) if o.success else 0 for o in outputs]
    ttfts, tpots, itls, e2els = [], [], [], []
    for out, n_out in zip(outputs, output_lens):
        if not out.success:
            continue
        ttfts.append(out.ttft)
        e2els.append(out.latency)
        itls.extend(out.itl)
        if n_out > 1:
            tpots.append((out.latency - out.ttft) / (n_out - 1))
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(output_lens)
    dur = duration_s if duration_s > 0 else math.inf
    t0 = min((o.start_time for o in ok), default=0.0)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(outputs) - len(ok), total_input=total_input,
        total_output=total_output, duration_s=duration_s,
        request_throughput=len(ok) / dur, output_throughput=total_output / dur,
        total_token_throughput=(total_input + total_output) / dur,
        max_output_tokens_per_s=_peak_tokens_per_s(ok, t0),
        max_concurrent_requests=_peak_concurrency(ok),
        stats={"ttft": _stats(ttfts, percentiles), "tpot": _stats(tpots, percentiles),
               "itl": _stats(itls, percentiles), "e2el": _stats(e2els, percentiles)},
        output_lens=output_lens)


def _row(label: str, value: Any, fmt: str = "") -> str:
    return f"{label:<40} {value:<10{fmt}}"


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def format_result_table(metrics: BenchmarkMetrics, max_concurrency: int | None,
                        request_rate: float, selected_metrics: list[str]) -> str:
    """vLLM's result table, as one string (no trailing newline)."""
    lines = [f"{_TITLE:=^{_WIDTH}}",
             _row("Successful requests:", metrics.completed),
             _row("Failed requests:", metrics.failed)]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_row("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [
        _row("Benchmark duration (s):", metrics.duration_s, ".2f"),
        _row("Total input tokens:", metrics.total_input),
        _row("Total generated tokens:", metrics.total_output),
        _row("Request throughput (req/s):", metrics.request_throughput, ".2f"),
        _row("Output token throughput (tok/s):", metrics.output_throughput, ".2f"),
        _row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s, ".2f"),
        _row("Peak concurrent requests:", float(metrics.max_concurrent_requests), ".2f"),
        _row("Total token throughput (tok/s):", metrics.total_token_throughput, ".2f"),
    ]
    for name in PERCENTILE_METRICS:
        if name not in selected_metrics:
            continue
        short, header = _METRIC_LABELS[name]
        st = metrics.stats[name]
        lines.append(f"{header:-^{_WIDTH}}")
        lines.append(_row(f"Mean {short} (ms):", st.mean, ".2f"))
        lines.append(_row(f"Median {short} (ms):", st.median, ".2f"))
        for p, value in st.percentiles:
            lines.append(_row(f"P{_percentile_word(p)} {short} (ms):", value, ".2f"))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def failure_report(outputs: list[RequestOutput]) -> str | None:
    """A short note on failed requests with the first error, or None when all succeeded."""
    failed = [o for o in outputs if not o.success]
    if not failed:
        return None
    return (f"Failed requests during benchmark run detected: {len(failed)} of {len(outputs)}.\n"
            f"First error: {failed[0].error}")


def result_dict(metrics: BenchmarkMetrics, outputs: list[RequestOutput],
                selected_metrics: list[str]) -> dict[str, Any]:
    """vLLM's result keys: totals, throughputs, per-request lists, mean/median/std/pNN per metric."""
    result: dict[str, Any] = {
        "duration": metrics.duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "request_goodput": None,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": metrics.output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
    }
    for name in PERCENTILE_METRICS:
        if name not in selected_metrics:
            continue
        st = metrics.stats[name]
        result[f"mean_{name}_ms"] = st.mean
        result[f"median_{name}_ms"] = st.median
        result[f"std_{name}_ms"] = st.std
        for p, value in st.percentiles:
            result[f"p{_percentile_word(p)}_{name}_ms"] = value
    return result
