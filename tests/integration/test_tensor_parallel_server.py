"""`serve --tensor-parallel-size 2` as real processes: single node, and two "nodes" on loopback (a head with
the API server and rank 0, a `--headless` process tree with rank 1) giving the same greedy text; a rank
killed (single node) or stopped (hung, on the other node) mid-request fails the request with an error and the
server exits unhealthy, both in bounded time.
"""
from __future__ import annotations

import pytest

import os
import signal
import threading
import time

import httpx

from tests.integration.server_utils import ServerProcess, rank_children, two_loopback_nodes, wait_for

pytestmark = pytest.mark.engine

COMMON = ["--enforce-eager", "--tensor-parallel-size", "2", "--max-model-len", "256", "--dtype", "float32",
          "--device", "cpu", "--num-gpu-blocks-override", "64", "--disable-log-stats"]
PROMPT = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
# The rank's death must end the request and the server within this: a hang is detected after
# VLLM_NEURON_DIST_TIMEOUT_S (10 s here); the rest is slack for a loaded CI machine (30 s was once exceeded there).
DEATH_BOUND_S = 60


def _complete(srv: ServerProcess) -> str:
    r = httpx.post(srv.url + "/v1/completions", json={"model": srv_model(srv), **PROMPT}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def srv_model(srv: ServerProcess) -> str:
    return httpx.get(srv.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def _fail_rank_mid_request(srv: ServerProcess, rank_pid: int, sig: int) -> None:
    """Streams a long request, sends `sig` to `rank_pid` once tokens flow (SIGKILL: the rank dies, SIGSTOP: it
    hangs); the stream must end with an error and the server exit non-zero, each within DEATH_BOUND_S."""
    result: dict = {}
    streaming = threading.Event()

    def stream() -> None:
        body = {"model": srv_model(srv), **PROMPT, "max_tokens": 200, "stream": True}
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                lines = result["lines"] = []
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        streaming.set()
        except Exception as e:  # noqa: BLE001 - a dropped connection is an answer too
            result["error"] = e

    t = threading.Thread(target=stream)
    t.start()
    assert streaming.wait(120), "the streaming request produced nothing"
    os.kill(rank_pid, sig)
    t0 = time.monotonic()
    t.join(DEATH_BOUND_S)
    assert not t.is_alive(), "the request hung after a rank died"
    lines = result.get("lines", [])
    assert "error" in result or any('"error"' in x for x in lines), lines[-3:]
    code = srv.proc.wait(DEATH_BOUND_S)
    assert code == 1, srv.log()[-3000:]
    assert time.monotonic() - t0 < DEATH_BOUND_S
    log = srv.log()
    assert "tensor parallel" in log and "The engine process died" in log, log[-3000:]


def test_single_and_multi_node_same_tokens_and_a_dead_rank_fails_fast(tiny_llama_dir, tmp_path):
    env = {"VLLM_NEURON_DIST_TIMEOUT_S": "10"}
    single = ServerProcess(tiny_llama_dir, COMMON, str(tmp_path), **env)
    try:
        single.wait_healthy(300)
        expected = _complete(single)
        (rank1,) = rank_children(single.engine_pid())
        # `kill -USR1` on a rank prints where its threads are (a hung collective's first question) and it goes on.
        os.kill(rank1, signal.SIGUSR1)
        wait_for(lambda: "follower_main" in single.log(), timeout=10, what="rank 1's stack dump")
        assert _complete(single) == expected
        _fail_rank_mid_request(single, rank1, signal.SIGKILL)
    finally:
        single.kill()

    with two_loopback_nodes(tiny_llama_dir, COMMON, tmp_path, **env) as (head, follower):
        head.wait_healthy(300)
        assert _complete(head) == expected, "two nodes and one node gave different greedy text"
        (remote_rank,) = rank_children(follower.pid)
        # Rank 1 lives in the other process tree and hangs: the head learns of it through the collectives'
        # timeout only (VLLM_NEURON_DIST_TIMEOUT_S).
        _fail_rank_mid_request(head, remote_rank, signal.SIGSTOP)
        assert "timed out" in head.log().lower(), head.log()[-3000:]
    node1 = (tmp_path / "node1.log").read_text(errors="replace")
    assert "Headless node 1: tensor parallel ranks 1..1" in node1, node1[-2000:]
