"""The benchmarks' shared helpers: step times grouped by bucket (benchmarks/step_timing.py), the
per-process CPU accounting of benchmarks/api_cpu_share.py (/proc readers, process tree, roles) and ab_steps.py's
summary table."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "benchmarks"))

import ab_steps  # noqa: E402
import api_cpu_share  # noqa: E402
import step_timing  # noqa: E402


def test_steps_of_takes_one_bucket_size_over_every_context_bucket():
    times = {"decode_b1": [0.01, 0.03], "decode_b1_c2048": [0.02], "decode_b16": [0.5], "prefill_s1": [0.7]}
    assert sorted(step_timing.steps_of(times, "decode", 1)) == [0.01, 0.02, 0.03]
    assert step_timing.steps_of(times, "prefill", 1) == [0.7]
    assert step_timing.median_ms(step_timing.steps_of(times, "decode", 1)) == pytest.approx(20.0)
    assert step_timing.steps_of(times, "decode", 4) == []


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds  # busy CPU in this thread (process time counts every thread)
    while time.thread_time() < end:
        pass


def test_ab_summary_reports_each_rounds_ratio_and_a_own_spread():
    rounds = [{"A": {"decode_b1": [0.010, 0.010], "prefill_s32": [0.1]}, "B": {"decode_b1": [0.009], "prefill_s32": [0.1]}},
              {"A": {"decode_b1": [0.012]}, "B": {"decode_b1": [0.012, 0.012], "only_b": [1.0]}}]
    # only buckets every child ran are compared (the second round's A ran no prefill_s32, B an extra bucket)
    assert [ln.split("|")[1].strip() for ln in ab_steps.summary_table(rounds).splitlines()[2:]] == ["decode_b1"]
    rounds[1]["A"]["prefill_s32"] = rounds[1]["B"]["prefill_s32"] = [0.2]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in ab_steps.summary_table(rounds).splitlines()[2:]]
    assert [r[0] for r in rows] == ["prefill_s32", "decode_b1"]
    decode = rows[1]
    assert decode[1] == "3 / 3" and decode[2] == "10.00" and decode[3] == "12.00"
    assert decode[5] == "0.900-1.000" and decode[6] == "1.200"  # round ratios 0.9 and 1.0; A's rounds 10 and 12 ms


def test_cpu_seconds_count_the_thread_that_burned_them():
    pid = os.getpid()
    got: dict = {}

    def worker():
        got["tid"] = threading.get_native_id()
        got["before"] = api_cpu_share.thread_seconds(pid)[got["tid"]][1]
        _burn(0.3)
        got["after"] = api_cpu_share.thread_seconds(pid)[got["tid"]][1]

    total0 = api_cpu_share.cpu_seconds(pid)
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert got["after"] - got["before"] >= 0.2  # clock ticks: 10 ms resolution
    assert api_cpu_share.cpu_seconds(pid) - total0 >= 0.2
    busy, total = api_cpu_share.machine_busy_seconds()
    assert 0 < busy <= total


def test_descendants_and_roles():
    ctx = multiprocessing.get_context("spawn")
    engine = ctx.Process(target=time.sleep, args=(30,), daemon=True)  # how replica.py starts an EngineCore
    engine.start()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        kids = api_cpu_share.descendants(os.getpid())
        assert engine.pid in kids and other.pid in kids
        assert api_cpu_share.role(engine.pid) == "EngineCore"
        assert api_cpu_share.role(other.pid).startswith(sys.executable)
    finally:
        engine.kill()
        other.kill()
        other.wait()
        engine.join()


def test_figures_read_from_bench_serve_table():
    report = "Benchmark duration (s):                  12.50     \nTotal generated tokens:                  8192      \n"
    assert api_cpu_share._figure(report, "Benchmark duration (s):") == 12.5
    assert api_cpu_share._figure(report, "Total generated tokens:") == 8192
    assert api_cpu_share._figure(report, "Mean TPOT (ms):") is None


@pytest.mark.parametrize("rows", [1, 3, 65])
def test_linear_rows_variants_compute_the_same_product(rows):
    import torch

    import linear_rows
    from vllm_neuron.model.layers.kernels.cpu_caps import linear_kernel_dtypes

    if len(linear_kernel_dtypes(torch.device("cpu"))) < 2:
        pytest.skip("no bf16 and fp32 linear kernels in this build")
    out = {name: fn() for name, fn in linear_rows.variants(rows, torch.Generator().manual_seed(rows)).items()}
    assert len(out) == 5
    for name, products in out.items():
        ref = out["F.linear fp32"]
        assert [p.shape for p in products] == [(rows, n) for n, _ in linear_rows.SHAPES], name
        # bf16 inputs: the products of the rounded inputs, summed in fp32 and rounded once (2^-8 relative)
        tol = dict(rtol=1e-4, atol=1e-3) if "fp32" in name else dict(rtol=2 ** -7, atol=0.5)
        for p, r in zip(products, ref):
            torch.testing.assert_close(p.float(), r, **tol, msg=name)


def test_quant_linear_rows_variants_compute_the_same_product():
    import torch

    import quant_linear_rows
    from vllm_neuron.model.layers.kernels.cpu_caps import quant_kernels_available

    if not quant_kernels_available(torch.device("cpu")):
        pytest.skip("no AVX2 here: the int8/int4 kernels are not built")
    torch.manual_seed(0)
    calls = quant_linear_rows.variants(64, 576, 3, torch.float32)
    out = {name: fn() for name, fn in calls.items()}
    tol = dict(rtol=1e-4, atol=1e-4)
    if "int8 int_dot" in out:  # an AVX2 build: its kernels take the integer-dot path, so the two A/B columns are it
        for scheme in ("int8", "int4"):
            assert torch.equal(out[f"{scheme} kernel"], out[f"{scheme} int_dot"])
        torch.testing.assert_close(out["int8 widened"], out["F.linear unquantized"], **tol)
        torch.testing.assert_close(out["int4 widened"], out["int4 dequant+matmul"], **tol)
        # inputs made int16: at most a 2^-15 step of a block's largest (~3) per input, times sum |w| (576 x ~0.04)
        tol = dict(rtol=1e-4, atol=2e-3)
    torch.testing.assert_close(out["int8 kernel"], out["F.linear unquantized"], **tol)
    torch.testing.assert_close(out["int8 dequant+matmul"], out["F.linear unquantized"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out["int4 kernel"], out["int4 dequant+matmul"], **tol)
