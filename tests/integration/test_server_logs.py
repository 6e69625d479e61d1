"""What a served log says and what a server leaves behind: a start from a fresh cache (the C++ kernels
built first) under a realistic timeout, saying that the engine still warms up after uvicorn's start-up and
when it is ready, vLLM's periodic stats line within 15 s of work, and no temporary folder left after a clean
shutdown. (No line with --disable-log-stats: test_server_e2e's keyed server.)"""
from __future__ import annotations

import pytest

import os
import time

import httpx

from tests.integration.server_utils import ServerProcess, wait_for

pytestmark = pytest.mark.engine

ARGS = ["--enforce-eager", "--max-model-len", "256", "--num-gpu-blocks-override", "32", "--max-num-seqs", "2"]
STATS = "Avg prompt throughput:"
# Building the kernels and starting the engine from an empty cache on 2 busy cores: minutes, not 60 s.
FRESH_START_TIMEOUT = 420


def _complete(srv: ServerProcess) -> None:
    r = httpx.post(srv.url + "/v1/completions", timeout=120,
                   json={"model": srv_model(srv), "prompt": "Hello there", "max_tokens": 8})
    assert r.status_code == 200, r.text


def srv_model(srv: ServerProcess) -> str:
    return httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_fresh_cache_stats_line_and_no_litter(tiny_llama_dir, tmp_path):
    cache_root = str(tmp_path / "fresh_cache")  # empty: the kernels are built first
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # The root's own kernels folder, built here: the generic class's build (the same sources and log lines,
    # most of their bodies compiled out), so the fresh start costs a fraction of the native build's ~100 s.
    srv = ServerProcess(tiny_llama_dir, ARGS, str(tmp_path), VLLM_CACHE_ROOT=cache_root,
                        VLLM_NEURON_KERNEL_CACHE_DIR="", VLLM_NEURON_CPU_ISA="generic",
                        TMPDIR=str(tmp), PROMETHEUS_MULTIPROC_DIR="")
    try:
        srv.wait_healthy(timeout=FRESH_START_TIMEOUT)
        # /health turns 200 a moment before the server's own "Ready" line is written (more on a loaded machine).
        log = wait_for(lambda: next((lg for lg in [srv.log()] if "Ready in " in lg), None), timeout=30,
                       interval=0.2, what="the 'Ready in' line")
        assert "Building the custom CPU kernels" in log  # the cache really was empty
        # uvicorn's "startup complete" comes long before the engine is warm: the next line says so, and one
        # line with the URL says when /health turned 200.
        started = log.index("Application startup complete")
        warming = log.index("the engine is still warming up")
        ready = log.index("Ready in ")
        assert started < warming < ready, log
        assert f"{srv.url}/v1" in log[ready:].splitlines()[0]
        assert any(n.startswith("vllm_neuron_prometheus_") for n in os.listdir(tmp))
        t0 = time.monotonic()
        _complete(srv)
        wait_for(lambda: STATS in srv.log(), timeout=15, interval=0.5, what="the periodic stats line")
        assert time.monotonic() - t0 < 15
        line = next(ln for ln in srv.log().splitlines() if STATS in ln)
        assert "Running:" in line and "GPU KV cache usage:" in line and "Prefix cache hit rate:" in line
        code, _ = srv.stop(timeout=30)
        assert code == 0, srv.log()[-4000:]
    finally:
        srv.kill()
    assert not [n for n in os.listdir(tmp) if n.startswith("vllm_neuron_")], os.listdir(tmp)
