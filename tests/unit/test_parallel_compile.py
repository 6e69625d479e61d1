"""run_bucket_workers (worker/parallel_compile.py) with fake workers: results, failures and deaths are
reported by bucket name."""
from __future__ import annotations

import os
import time

import pytest

from vllm_neuron.worker.parallel_compile import ParallelCompileError, run_bucket_workers


def _fake_worker(tasks, results, fail: str, die: str) -> None:
    pid = os.getpid()
    while True:
        name = tasks.get()
        if name is None:
            return
        results.put(("start", pid, name))
        if name == die:
            time.sleep(0.2)
            os._exit(3)  # a crash in native code: no report
        if name == fail:
            results.put(("fail", pid, name, "RuntimeError: no luck"))
        else:
            results.put(("done", pid, name, 0.01))


def test_every_bucket_done_once():
    names = [f"b{i}" for i in range(6)]
    assert sorted(run_bucket_workers(names, 3, _fake_worker, ("-", "-"))) == names


def test_failed_and_dead_workers_are_reported_by_bucket():
    names = ["prefill_s32", "decode_b1", "decode_b2", "decode_b4"]
    with pytest.raises(ParallelCompileError) as info:
        run_bucket_workers(names, 2, _fake_worker, ("decode_b1", "decode_b2"))
    failures = {f.name: f.reason for f in info.value.failures}
    assert failures["decode_b1"] == "RuntimeError: no luck"
    assert failures["decode_b2"] == "the compile worker died (exit code 3)"
    assert "bucket decode_b1: RuntimeError: no luck" in str(info.value)


def _run_in_daemon(out) -> None:
    out.put(sorted(run_bucket_workers(["x", "y"], 2, _fake_worker, ("-", "-"))))


def test_workers_start_from_a_daemonic_engine_process():
    """The API server runs the EngineCore as a daemonic process; warm-up's workers must start there too."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_run_in_daemon, args=(out,), daemon=True)
    proc.start()
    try:
        assert out.get(timeout=120) == ["x", "y"]
    finally:
        proc.join(30)
