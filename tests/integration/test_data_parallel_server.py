"""Multi-node data parallelism simulated on loopback: `vllm-neuron serve --data-parallel-size 2
--data-parallel-size-local 1` (the head: API server and replica 0) and `serve --headless
--data-parallel-start-rank 1` (a node: replica 1) as separate process trees.

The deployment serves concurrent requests on both replicas with the greedy texts of a single offline
engine (the head's /metrics shows both replicas by their `engine` label: the node forwards its
replica's samples). Killing the node's replica mid-request fails that request with an error
naming it, turns the head's /health 503 within seconds, and the head serves on with replica 0.
(tests/integration/test_data_parallel.py covers one host: 32 requests, prefix co-location, a killed
local replica.)
"""
from __future__ import annotations

import pytest

import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
from prometheus_client import CollectorRegistry, generate_latest, multiprocess

from tests.engine_gate import GATE_ENV, gate_paced
from tests.integration.server_utils import ServerProcess, free_port, wait_for
from vllm_neuron import LLM, SamplingParams

pytestmark = pytest.mark.engine

# The engines' steps are slowed while the test waits for a stream on each replica (tests/engine_gate.py): on a
# fast machine a 1,000-token stream could end before the poll saw it, on a loaded one the two could miss each other.
ARGS = ["--enforce-eager", "--max-model-len", "1024", "--num-gpu-blocks-override", "128", "--max-num-seqs", "8",
        "--dtype", "float32", "--logits-processors", "tests.engine_gate:EngineGate"]
PROMPTS = [f"Story {i}: the {w} went" for i, w in enumerate(["cat", "river", "engine", "moon"] * 2)]


def _started(node: ServerProcess) -> dict[int, int]:
    """rank -> pid of the replicas a headless node started, from its log."""
    return {int(r): int(p) for r, p in re.findall(r"ranks \[(\d+)\] \(pids \[(\d+)\]\)", node.log())}


def _complete(url: str, prompt: str, max_tokens: int = 8) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": _model(url), "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, "ignore_eos": True}, timeout=120)


def _model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_multi_node_dp_on_loopback_serves_and_reports_a_lost_node_replica(tiny_llama_dir, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("multinode"))
    rpc = free_port()
    common = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address", "127.0.0.1",
              "--data-parallel-rpc-port", str(rpc)]
    gate = {GATE_ENV: os.path.join(tmp, "gate")}
    head = ServerProcess(tiny_llama_dir, ARGS + common, tmp, **gate)
    node = ServerProcess(tiny_llama_dir, ARGS + common + ["--headless", "--data-parallel-start-rank", "1"], tmp, **gate)
    try:
        head.wait_healthy(timeout=180)
        assert "Data parallel rank 1 joined" in head.log()
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda p: _complete(head.url, p), PROMPTS))
        assert [r.status_code for r in got] == [200] * len(PROMPTS)
        # The greedy texts of one offline engine with the same options.
        llm = LLM(tiny_llama_dir, enforce_eager=True, max_model_len=1024, num_gpu_blocks_override=128, max_num_seqs=8,
                  dtype="float32")
        want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8,
                                                                                ignore_eos=True), use_tqdm=False)]
        del llm
        assert [r.json()["choices"][0]["text"] for r in got] == want
        head_text = httpx.get(head.url + "/metrics", timeout=10).text
        assert _metric(head_text, "vllm_neuron:neff_execution_count_total", engine="0") > 0
        # The node sends its replicas' samples to the head every 2 s: /metrics shows both replicas.
        wait_for(lambda: _metric(httpx.get(head.url + "/metrics", timeout=10).text,
                                 "vllm_neuron:neff_execution_count_total", engine="1") > 0,
                 timeout=45, what="the node's replica in the head's /metrics")
        # The headless node's replica executed graphs: its metrics live in the node's own folder.
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=node.env["PROMETHEUS_MULTIPROC_DIR"])
        node_text = generate_latest(registry).decode()
        assert _metric(node_text, "vllm_neuron:neff_execution_count_total", engine="1") > 0
        # Its replica dies mid-stream: that stream ends with an error naming it, within seconds.
        streams: dict[int, list] = {0: [], 1: []}
        leave = threading.Event()

        def long_stream(i: int) -> None:
            body = {"model": _model(head.url), "prompt": f"Long story number {i}:", "max_tokens": 1000,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", head.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        streams[i].append(line)
                    if leave.is_set():
                        return  # closing the stream aborts the request

        def running() -> tuple[float, float]:
            return (_metric(httpx.get(head.url + "/metrics", timeout=10).text, "vllm:num_requests_running"),
                    _metric(generate_latest(registry).decode(), "vllm:num_requests_running"))

        threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(2)]
        with gate_paced(gate[GATE_ENV], 0.05):  # a stream lasts 50 s at least while the test waits
            # One per replica (least outstanding work): the second starts once the first runs somewhere, else two
            # requests arriving together could both see two idle replicas and take the same one.
            threads[0].start()
            wait_for(lambda: sum(running()) >= 1, timeout=60, interval=0.05, what="the first request running")
            threads[1].start()
            wait_for(lambda: min(running()) >= 1, timeout=60, interval=0.05, what="a request running on each replica")
            os.kill(_started(node)[1], signal.SIGKILL)
        failed = wait_for(lambda: [i for i in (0, 1) if not threads[i].is_alive()
                                   and any("data parallel replica 1 died" in line for line in streams[i])],
                          timeout=45, what="the stream on the dead replica to end with its error")
        victim = failed[0]
        assert streams[victim][-1] == "data: [DONE]" and "error" in streams[victim][-2], streams[victim][-3:]
        leave.set()
        threads[1 - victim].join(60)
        assert streams[1 - victim] and not any('"error"' in line for line in streams[1 - victim])  # replica 0's
        health = httpx.get(head.url + "/health", timeout=10)
        assert health.status_code == 503 and "data parallel replica 1 died" in health.text
        assert _complete(head.url, "Still there?", 4).status_code == 200
        assert head.proc.poll() is None and "Data parallel replica 1 is dead" in head.log()
        # The node exits once its replicas are gone, and a SIGTERM'd head ends cleanly.
        wait_for(lambda: node.proc.poll() is not None, timeout=45, what="the headless node to exit")
        code, _ = head.stop(timeout=60)
        assert code == 0, head.log()[-4000:]
    finally:
        node.kill()
        head.kill()
