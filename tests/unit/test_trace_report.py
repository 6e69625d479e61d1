"""`vllm-neuron profile`'s trace analysis (entrypoints/cli/trace_report.py) on a hand-made Chrome trace, and the
profiler's refusal without VLLM_TORCH_PROFILER_DIR."""
from __future__ import annotations

import json

import pytest

from vllm_neuron import profiler
from vllm_neuron.entrypoints.cli.trace_report import analyze, format_report


def _x(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid, "cat": "cpu_op"}


def test_per_bucket_graph_host_ops_and_bubbles(tmp_path):
    events = [
        _x("schedule", 0, 5, tid=2),
        # step 1: decode_b4; graph 10..40 with aten::mm 12..32 containing aten::addmm-ish child 14..24
        _x("execute", 5, 45), _x("build_inputs", 5, 5), _x("graph", 10, 30), _x("bucket:decode_b4", 10, 30),
        _x("aten::mm", 12, 20), _x("aten::copy_", 14, 10), _x("aten::add", 33, 4), _x("sample", 40, 10),
        _x("output", 52, 3, tid=2),
        # step 2: prefill_s32, 20 us after the first graph ended
        _x("execute", 55, 30), _x("graph", 60, 20), _x("bucket:prefill_s32", 60, 20), _x("aten::mm", 61, 18),
        _x("detokenize", 90, 2, tid=2),
        {"ph": "M", "name": "thread_name", "pid": 7, "tid": 1},
    ]
    path = tmp_path / "t.engine0_rank0.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = analyze(path)
    assert set(r.buckets) == {"decode_b4", "prefill_s32"}
    d, p = r.buckets["decode_b4"], r.buckets["prefill_s32"]
    assert d.count == 1 and d.graph_us == [30] and d.host_us == [15] and d.bubble_us == []
    assert p.graph_us == [20] and p.host_us == [10] and p.bubble_us == [20]
    # self times: mm 20 - copy_ 10 = 10, copy_ 10, add 4 (of a 30 us graph)
    assert dict(d.op_self_us) == {"aten::mm": 10, "aten::copy_": 10, "aten::add": 4}
    assert d.top_ops(1)[0][1] == pytest.approx(10 / 30)
    assert r.phases_us == {"schedule": 5, "build_inputs": 5, "graph": 50, "sample": 10, "output": 3,
                           "detokenize": 2}
    assert r.graph_span_us == 70 and r.graph_busy_us == 50
    text = format_report(r, top_ops=2)
    assert "decode_b4" in text and "prefill_s32" in text and "graphs busy 71%" in text


def test_a_file_that_is_no_trace_is_named(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("[1, 2")
    with pytest.raises(ValueError, match="x.json is not a readable Chrome trace"):
        analyze(bad)


def test_profiling_is_refused_without_the_folder(monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    session = profiler.TraceSession()
    with pytest.raises(profiler.ProfilerError, match="VLLM_TORCH_PROFILER_DIR"):
        session.start("api_server", "t")
    with pytest.raises(profiler.ProfilerError, match="no profile is running"):
        session.stop()
    assert not profiler.active()
    with profiler.phase("x"):  # a no-op without a profiler
        pass
