"""A profile's trace (vllm_neuron/profiler.py's Chrome trace JSON) -> per-bucket figures (pure but for reading).

From one engine process' trace: each "bucket:<name>" range is one graph execution; the "execute" range around
it is the runner's step, so host time = step - graph; ops inside the graph range are ranked by self time
(a parent op's time minus its children's); a bubble is the gap between one graph execution's end and the
next one's start (the time the device would idle between steps); the host phases (profiler.PHASES) are summed.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from vllm_neuron.profiler import BUCKET_PREFIX, PHASES

_OURS = set(PHASES) | {"execute"}


@dataclass(frozen=True)
class Span:
    name: str
    ts: float  # microseconds
    dur: float
    tid: object

    @property
    def end(self) -> float:
        return self.ts + self.dur


@dataclass
class BucketStats:
    name: str
    count: int = 0
    graph_us: list[float] = field(default_factory=list)
    host_us: list[float] = field(default_factory=list)  # the step's time outside its graphs
    bubble_us: list[float] = field(default_factory=list)  # gap from the previous graph execution's end
    op_self_us: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def top_ops(self, k: int) -> list[tuple[str, float]]:
        """(op, share of the graph time) of the k ops with the most self time inside this bucket's graphs."""
        total = sum(self.graph_us) or 1.0
        ops = sorted(self.op_self_us.items(), key=lambda kv: -kv[1])[:k]
        return [(name, us / total) for name, us in ops]


@dataclass
class TraceReport:
    path: str
    buckets: dict[str, BucketStats]
    phases_us: dict[str, float]
    graph_span_us: float  # first graph start to last graph end
    graph_busy_us: float


def load_spans(path: str | Path) -> list[Span]:
    """The complete ("X") events of a Chrome trace; ValueError naming the file if it is not one."""
    try:
        data = json.loads(Path(path).read_text())
        events = data["traceEvents"] if isinstance(data, dict) else data
        return [Span(e["name"], float(e["ts"]), float(e.get("dur", 0.0)), (e.get("pid"), e.get("tid")))
                for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a readable Chrome trace: {type(e).__name__}: {e}") from None


def _self_times(spans: list[Span]) -> list[tuple[Span, float]]:
    """Each span of one thread with its self time (nesting by containment)."""
    out: list[list] = []
    stack: list[list] = []
    for s in sorted(spans, key=lambda s: (s.ts, -s.dur)):
        while stack and stack[-1][0].end <= s.ts:
            stack.pop()
        entry = [s, s.dur]
        if stack and s.end <= stack[-1][0].end + 1e-3:
            stack[-1][1] -= s.dur
        stack.append(entry)
        out.append(entry)
    return [(s, max(t, 0.0)) for s, t in out]


def analyze(path: str | Path) -> TraceReport:
    spans = load_spans(path)
    by_tid: dict[object, list[Span]] = defaultdict(list)
    for s in spans:
        by_tid[s.tid].append(s)
    graphs = sorted((s for s in spans if s.name.startswith(BUCKET_PREFIX)), key=lambda s: s.ts)
    buckets: dict[str, BucketStats] = {}
    prev_end = None
    for g in graphs:
        b = buckets.setdefault(g.name[len(BUCKET_PREFIX):], BucketStats(g.name[len(BUCKET_PREFIX):]))
        b.count += 1
        b.graph_us.append(g.dur)
        if prev_end is not None:
            b.bubble_us.append(max(g.ts - prev_end, 0.0))
        prev_end = g.end
    for tid, thread in by_tid.items():
        executes = sorted((s for s in thread if s.name == "execute"), key=lambda s: s.ts)
        thread_graphs = [g for g in graphs if g.tid == tid]
        for ex in executes:
            inside = [g for g in thread_graphs if g.ts >= ex.ts and g.end <= ex.end + 1e-3]
            if inside:
                buckets[inside[-1].name[len(BUCKET_PREFIX):]].host_us.append(ex.dur - sum(g.dur for g in inside))
        if not thread_graphs:
            continue
        for s, self_us in _self_times(thread):
            if s.name in _OURS or s.name.startswith(BUCKET_PREFIX):
                continue
            g = _enclosing(thread_graphs, s)
            if g is not None:
                buckets[g.name[len(BUCKET_PREFIX):]].op_self_us[s.name] += self_us
    phases = {p: sum(s.dur for s in spans if s.name == p) for p in PHASES}
    span_us = graphs[-1].end - graphs[0].ts if graphs else 0.0
    return TraceReport(str(path), buckets, phases, span_us, sum(g.dur for g in graphs))


def _enclosing(graphs: list[Span], s: Span) -> Span | None:
    lo, hi = 0, len(graphs)
    while lo < hi:  # the last graph starting at or before s
        mid = (lo + hi) // 2
        if graphs[mid].ts <= s.ts:
            lo = mid + 1
        else:
            hi = mid
    if lo and s.end <= graphs[lo - 1].end + 1e-3:
        return graphs[lo - 1]
    return None


def _ms(values: list[float]) -> str:
    return f"{statistics.fmean(values) / 1e3:.2f}" if values else "-"


def format_report(r: TraceReport, top_ops: int = 3) -> str:
    if not r.buckets:
        return f"{r.path}: no graph executions (bucket:* ranges) in this trace"
    busy = r.graph_busy_us / r.graph_span_us if r.graph_span_us else 0.0
    lines = [f"{Path(r.path).name}: {sum(b.count for b in r.buckets.values())} graph executions; graphs busy "
             f"{busy:.0%} of the {r.graph_span_us / 1e3:.1f} ms from the first to the last",
             "means per execution, in ms; host = the runner's step outside its graph (inputs, sampling); "
             "bubble = gap since the previous graph execution ended"]
    header = ("bucket", "count", "graph", "host", "host %", "bubble", f"top {top_ops} ops in the graph (self time)")
    rows = []
    for b in sorted(r.buckets.values(), key=lambda b: -sum(b.graph_us)):
        host = statistics.fmean(b.host_us) if b.host_us else 0.0
        graph = statistics.fmean(b.graph_us)
        share = f"{host / (host + graph):.0%}" if b.host_us and host + graph > 0 else "-"
        ops = ", ".join(f"{n} {s:.0%}" for n, s in b.top_ops(top_ops)) or "-"
        rows.append((b.name, str(b.count), _ms(b.graph_us), _ms(b.host_us), share, _ms(b.bubble_us), ops))
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        lines.append("  " + "  ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in
                                       enumerate(zip(row, widths))) + "  " + row[-1])
    lines.append("host phases (total ms): " + ", ".join(f"{p} {us / 1e3:.1f}" for p, us in r.phases_us.items()))
    return "\n".join(lines)
