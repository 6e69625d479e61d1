"""benchmarks/step_bounds.py: the bound of a step (pure), and one run on a tiny model printing a row per
step kind it ran."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.integration.bench_scripts import REPO, load_script, script_path

_SCRIPT = script_path("step_bounds")


@pytest.fixture(scope="module")
def sb():
    return load_script("step_bounds")


def test_bound_is_the_slower_of_compute_and_memory(sb):
    decode = sb.step_cost(linear_params=100e6, weight_bytes=200_000_000, rows=1, kv_bytes_per_token=1000,
                          context_tokens=1000)
    assert decode.flops == 2 * 100e6 and decode.bytes == 201_000_000
    assert sb.bound_ms(decode, peak_flop_s=100e9, bandwidth_b_s=20e9) == (pytest.approx(10.05), "memory")
    prefill = sb.step_cost(100e6, 200_000_000, rows=512, kv_bytes_per_token=1000, context_tokens=512)
    ms, by = sb.bound_ms(prefill, peak_flop_s=100e9, bandwidth_b_s=20e9)
    assert by == "compute" and ms == pytest.approx(2 * 100e6 * 512 / 100e9 * 1e3)


def test_bounds_take_the_higher_of_the_two_bandwidth_probes(sb):
    # A bound the machine beats bounds nothing: the VM's bandwidth moves by 2-3x within a minute.
    assert sb.bandwidth_for_bounds(20e9, 31e9) == 31e9
    assert sb.bandwidth_for_bounds(31e9, 20e9) == 31e9


def test_the_peak_is_fp32_where_bf16_linears_run_widened(sb):
    # The AVX2 class: torch's bf16 matmul is emulated there, and the engine's bf16 linears run in fp32 instead.
    assert sb.peak_dtype("bfloat16", widens=True) == "float32"
    assert sb.peak_dtype("bfloat16", widens=False) == "bfloat16"
    assert sb.peak_dtype("float32", widens=True) == "float32"


@pytest.mark.engine
def test_tiny_model_run_prints_every_step_kind(tiny_llama_dir):
    env = dict(os.environ)  # the tests' cache root (conftest): kernels built once; eager writes no graphs
    proc = subprocess.run([sys.executable, _SCRIPT, "--model", tiny_llama_dir, "--eager", "--dtype", "float32",
                           "--repeat", "1",
                           "--prefill-buckets", "16,32", "--decode-buckets", "1,2", "--decode-tokens", "3",
                           "--decode-batches", "1,2", "--matmul-size", "256", "--bandwidth-gib", "0.05",
                           "--threads", "1"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "fp32 matmul peak" in out and "read bandwidth" in out  # the peak is measured in the engine's dtype
    assert "read bandwidth after the steps" in out and "the bounds take" in out
    assert "float32 weights" in out
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0] == "step (bucket graph)"
    assert rows[1:] == ["prefill_s16", "prefill_s32", "decode_b1", "decode_b2"], out
