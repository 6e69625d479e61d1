"""Profiling, step timing and the bucket advisor on the offline engine (tiny random Llama, eager, async
scheduling on so that the runner's steps run on their own thread): LLM.start_profile / stop_profile refused
without VLLM_TORCH_PROFILER_DIR, the trace's ranges against the engine's own per-step DEBUG lines, the
served-shape summary and `buckets advise` on it and on the log, and `vllm-neuron profile`'s table."""
from __future__ import annotations

import contextlib
import io
import json
import logging
import re
from collections import Counter

import pytest

from vllm_neuron import SamplingParams
from vllm_neuron.config.bucket_advisor import Limits, Lists, validate_lists
from vllm_neuron.config.neuron_config import parse_additional_config
from vllm_neuron.engine.served_shapes import SUMMARY_NAME
from vllm_neuron.entrypoints.cli.main import main
from vllm_neuron.entrypoints.cli.trace_report import analyze
from vllm_neuron.profiler import PHASES, ProfilerError

from tests.integration.server_utils import run_cli
from tests.model_factory import TINY_ENGINE, tiny_llm

pytestmark = pytest.mark.engine

# TINY_ENGINE: max_num_batched_tokens 32 (a 45-token prompt is prefilled in two segments), max_num_seqs 8.
PROMPTS = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (10, 20, 45)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
_STEP_LINE = re.compile(r"^step (\S+) (tokens|seqs)=(\d+)/(\d+) context=\d+ execute_ms=([\d.]+) graph_ms=([\d.]+)$")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return tiny_llm(tiny_llama_dir, async_scheduling=True)


def _run_capture(args: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    return buf.getvalue()


def _advised(out: str) -> dict:
    return json.loads(out.split("--additional-config '")[1].strip().rstrip("'"))["neuron_config"]


def _check_proposal(config: dict) -> None:
    nc = parse_additional_config({"neuron_config": config}).neuron_config
    nc.validate(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=256, block_size=16)


def test_profiling_is_refused_without_the_folder(llm, monkeypatch):
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(ProfilerError, match="VLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", "/nonexistent-but-unused")
    with pytest.raises(ProfilerError, match="no profile is running"):
        llm.stop_profile()
    assert llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0].outputs[0].token_ids  # the engine goes on


def test_trace_has_a_range_per_executed_bucket_and_per_phase(llm, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    monkeypatch.setenv("VLLM_TORCH_PROFILER_WITH_STACK", "0")
    caplog.set_level(logging.DEBUG, logger="vllm_neuron.engine.core")
    llm.start_profile()
    with pytest.raises(ProfilerError, match="already running"):
        llm.start_profile()
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    traces = llm.stop_profile()
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4]
    steps = [m for r in caplog.records if (m := _STEP_LINE.match(r.getMessage()))]
    assert steps, "no per-step DEBUG lines"
    for m in steps:
        assert int(m[3]) <= int(m[4]) and float(m[6]) <= float(m[5]) and float(m[5]) > 0
    executed = Counter(m[1] for m in steps)
    assert any(b.startswith("prefill_s32") for b in executed) and any(b.startswith("decode_b") for b in executed)

    assert len(traces) == 1 and traces[0].endswith(".engine0_rank0.pt.trace.json"), traces
    events = [e for e in json.load(open(traces[0]))["traceEvents"] if e.get("ph") == "X"]
    names = Counter(e["name"] for e in events)
    assert Counter({n[len("bucket:"):]: c for n, c in names.items() if n.startswith("bucket:")}) == executed
    for phase in PHASES + ("execute",):
        assert names[phase] > 0, f"no {phase} range in the trace"
    # The step thread (async scheduling) ran the graphs; the main thread scheduled: both were recorded.
    tids = {e["name"]: e["tid"] for e in events if e["name"] in ("schedule", "graph")}
    assert tids["schedule"] != tids["graph"]
    report = analyze(traces[0])
    assert set(report.buckets) == set(executed)
    assert all(b.host_us and b.count == executed[name] for name, b in report.buckets.items())

    log = tmp_path / "engine.log"
    log.write_text("\n".join("DEBUG " + m[0] for m in steps))
    args = ["buckets", "advise", "--from-log", str(log), "--max-num-batched-tokens", "32", "--max-num-seqs", "8",
            "--max-model-len", "256"]
    _check_proposal(_advised(_run_capture(args)))


def test_served_shape_summary_feeds_the_advisor(llm):
    core = llm.llm_engine.core
    before = core.served.total.steps
    llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert core.served.total.steps > before
    assert core.served.total.seconds["prefill"] > 0 and core.served.total.seconds["decode"] > 0
    core.served.flush()
    path = core.compiler.dir / SUMMARY_NAME
    out = _run_capture(["buckets", "advise", "--from-summary", str(path)])
    config = _advised(out)
    _check_proposal(config)
    validate_lists(Lists(tuple(config["num_batched_tokens_buckets"]), tuple(config["num_seqs_buckets"]),
                         tuple(config["decode_context_length_buckets"] or ()) + (256,)), Limits(32, 8, 256, 16))
    assert "decode padding" in out


def test_profile_command_prints_a_table_per_bucket(tiny_llama_dir, tmp_path):
    flags = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in TINY_ENGINE.items()]
    res = run_cli(["profile", tiny_llama_dir, *flags, "--num-prompts", "2", "--input-len", "20", "--output-len", "3",
                   "--profile-dir", str(tmp_path)], str(tmp_path), timeout=180)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert re.search(r"^\s+prefill_s32\s+\d+\s+[\d.]+\s+[\d.]+", res.stdout, re.M), out
    assert re.search(r"^\s+decode_b\d+\s+\d+", res.stdout, re.M), out  # CPU decode buckets: 1, 4, 8
    assert "host phases (total ms): schedule" in res.stdout and ".engine0_rank0.pt.trace.json" in res.stdout
