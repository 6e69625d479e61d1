"""The per-step `vllm_neuron:*` series (VLLM_NEURON_STEP_TIMING=1, the default): each bucket's step and graph
times and fill ratio, and the step shapes served (what the bucket advisor reads from /metrics).

Recorded by the engine process (driver rank) once per step, like metrics.py's engine-side series, whose
multiprocess set-up and labels (model_name, engine) these share; they appear in /metrics after the first step
(vllm_neuron:bucket_graphs at start-up).
"""
from __future__ import annotations

from prometheus_client import Gauge, Histogram

from vllm_neuron import metrics

_MB = ["model_name", "engine", "bucket_name"]
_ME = ["model_name", "engine"]
STEP_TIME_BUCKETS = [0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                     0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0]
FILL_BUCKETS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0]


def quarter_octaves(first: int, last: int, multiple: int = 1) -> list[int]:
    """Every multiple of `multiple` from `first` while that is finer than a quarter octave, then quarter octaves
    (rounded up to the multiple) up to `last`: bounds fine enough for the advisor at ~50-70 buckets."""
    out, v = [], first
    while v <= last:
        out.append(v)
        v = max(v + multiple, -(-int(v * 2 ** 0.25) // multiple) * multiple)
    return out


SHAPE_TOKENS_BUCKETS = quarter_octaves(1, 2 ** 17)
SHAPE_SEQS_BUCKETS = quarter_octaves(1, 4096)
SHAPE_CONTEXT_BUCKETS = quarter_octaves(128, 2 ** 20, 128)

STEP_EXECUTION_TIME = Histogram("vllm_neuron:step_execution_seconds", "Wall time of one model runner step (inputs, "
                                "graph, host sampling), by bucket.", _MB, registry=None, buckets=STEP_TIME_BUCKETS)
GRAPH_EXECUTION_TIME = Histogram("vllm_neuron:graph_execution_seconds", "Time in the bucket graph's call within one "
                                 "step (on CUDA: its launch), by bucket.", _MB, registry=None,
                                 buckets=STEP_TIME_BUCKETS)
BUCKET_FILL_RATIO = Histogram("vllm_neuron:bucket_fill_ratio", "Real tokens (prefill) or sequences (decode) over the "
                              "bucket's size, per execution: 1 - the padding ratio.", _MB, registry=None,
                              buckets=FILL_BUCKETS)
PREFILL_STEP_TOKENS = Histogram("vllm_neuron:prefill_step_tokens", "Tokens of each prefill step (before padding).",
                                _ME, registry=None, buckets=SHAPE_TOKENS_BUCKETS)
DECODE_STEP_SEQS = Histogram("vllm_neuron:decode_step_seqs", "Sequences of each decode step (before padding).",
                             _ME, registry=None, buckets=SHAPE_SEQS_BUCKETS)
DECODE_STEP_CONTEXT = Histogram("vllm_neuron:decode_step_context_tokens", "Longest sequence of each decode step, "
                                "new token included (what its context bucket must hold).", _ME, registry=None,
                                buckets=SHAPE_CONTEXT_BUCKETS)

# 1 per graph the engine has (compiled or eager), from its start: the bucket lists for `buckets advise --from`.
BUCKET_GRAPHS = Gauge("vllm_neuron:bucket_graphs", "1 for each bucket graph of the engine (its bucket lists).", _MB,
                      registry=None, multiprocess_mode="max")

# Every series name as exposed, for docs and tests.
SERIES_NAMES: tuple[str, ...] = (
    "vllm_neuron:step_execution_seconds", "vllm_neuron:graph_execution_seconds", "vllm_neuron:bucket_fill_ratio",
    "vllm_neuron:prefill_step_tokens", "vllm_neuron:decode_step_seqs", "vllm_neuron:decode_step_context_tokens",
    "vllm_neuron:bucket_graphs")


def record_bucket_graphs(names: list[str]) -> None:
    """The engine's graphs, once at start-up."""
    for name in names:
        BUCKET_GRAPHS.labels(*metrics.engine_labels(), name).set(1)


# Labelled children by (model_name, engine[, bucket_name]): .labels() costs more than the observation itself,
# once per step per series otherwise.
_children: dict[tuple[str, ...], tuple] = {}


def _labelled(labels: tuple[str, ...], *series: Histogram) -> tuple:
    key = (*labels, *(str(id(h)) for h in series))
    out = _children.get(key)
    if out is None:
        out = _children[key] = tuple(h.labels(*labels) for h in series)
    return out


def record_step_timing(bucket_name: str, execute_s: float, graph_s: float, fill_ratio: float) -> None:
    """One step of bucket `bucket_name`: the runner's time, its graphs', real / bucket size. Driver rank only."""
    step, graph, fill = _labelled((*metrics.engine_labels(), bucket_name), STEP_EXECUTION_TIME,
                                  GRAPH_EXECUTION_TIME, BUCKET_FILL_RATIO)
    step.observe(execute_s)
    graph.observe(graph_s)
    fill.observe(fill_ratio)


def record_served_shape(kind: str, size: int, context: int = 0) -> None:
    """One step's shape before padding: "prefill" (size = tokens) or "decode" (size = sequences, context = the
    longest sequence)."""
    if kind == "prefill":
        _labelled(metrics.engine_labels(), PREFILL_STEP_TOKENS)[0].observe(size)
    elif kind == "decode":
        seqs, ctx = _labelled(metrics.engine_labels(), DECODE_STEP_SEQS, DECODE_STEP_CONTEXT)
        seqs.observe(size)
        ctx.observe(context)
    else:
        raise ValueError(f"kind must be one of 'prefill', 'decode'; got {kind!r}")
