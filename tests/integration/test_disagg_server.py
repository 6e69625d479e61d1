"""Disaggregated prefill/decode between real servers, through `vllm-neuron disagg-proxy` (2P2D: two prefill
instances, a TP=2 decode instance and a TP=1 one) and through vLLM's protocol directly: greedy fp32 tokens equal
transformers'; kv_transfer_params field for field; forged or stale params fall back to a local prefill (never a
500, never another request's KV); blocks no reader comes for are freed after the hold timeout; a dead prefill
instance is skipped; every instance's KV pool back to empty after each test."""
from __future__ import annotations

import json
import os
import subprocess
import threading

import httpx
import pytest

from tests.integration.server_utils import ServerProcess, child_env, cli, free_port, wait_for
from tests.model_factory import build_tiny_model, greedy_reference, shared_prefix_prompts

pytestmark = pytest.mark.engine

MAX_NEW = 8
PROMPTS = shared_prefix_prompts([20, 45, 70, 33], 32, first_shared=1, seed=9)
ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--block-size", "16"]
HOLD_S = 3


def _kv(role: str, hold_s: float = HOLD_S) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "TcpConnector", "kv_role": role, "kv_port": free_port(),
                                                "kv_connector_extra_config": {"hold_timeout_s": hold_s}})]


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], tmp_dir: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp_dir, f"proxy-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cli() + ["disagg-proxy", "--prefill", *prefill, "--decode", *decode, "--port",
                                              str(self.port)], env=child_env(tmp_dir), stdout=self._log,
                                     stderr=subprocess.STDOUT)
        wait_for(self._up, 30, what="the proxy")

    def _up(self) -> bool:
        assert self.proc.poll() is None, open(self.log_path).read()
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def fleet(tiny_llama_dir, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("disagg"))
    servers = {"p1": ServerProcess(tiny_llama_dir, ARGS + _kv("kv_producer"), tmp),
               # p2 holds long: the forgery test's real reader comes after several local prefills (a loaded CI).
               "p2": ServerProcess(tiny_llama_dir, ARGS + _kv("kv_producer", 120), tmp),
               "d1": ServerProcess(tiny_llama_dir, ARGS + ["--tensor-parallel-size", "2"] + _kv("kv_consumer"), tmp),
               "d2": ServerProcess(tiny_llama_dir, ARGS + _kv("kv_both"), tmp)}
    proxies = []
    try:
        for srv in servers.values():
            srv.wait_healthy(timeout=180)
        servers["proxy"] = Proxy([servers["p1"].url, servers["p2"].url], [servers["d1"].url, servers["d2"].url], tmp)
        proxies.append(servers["proxy"])
        yield servers, tmp
    finally:
        for p in proxies:
            p.stop()
        for name, srv in servers.items():
            if name != "proxy":
                srv.stop()
                srv.kill()


@pytest.fixture(scope="module")
def reference():
    return greedy_reference(build_tiny_model("llama"), PROMPTS, MAX_NEW)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in "{ ")


@pytest.fixture(autouse=True)
def _pools_back(fleet):
    yield
    servers, _ = fleet
    for name in ("p1", "p2", "d1", "d2"):
        srv = servers[name]
        if srv.proc.poll() is None:
            wait_for(lambda: _metric(srv.url, "vllm:kv_cache_usage_perc") == 0, HOLD_S + 10,
                     what=f"{name}'s KV pool back to empty")


def _complete(url: str, prompt: list[int], **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
        **extra})


def test_2p2d_through_the_proxy_equals_transformers(fleet, reference):
    servers, _ = fleet
    proxy = servers["proxy"]
    before = {n: _metric(servers[n].url, "vllm_neuron:kv_transfer_blocks_total") for n in ("d1", "d2")}
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:
        r = _complete(proxy.url, PROMPTS[i])
        assert r.status_code == 200, r.text
        results[i] = r.json()["choices"][0]["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [results[i] for i in range(len(PROMPTS))] == reference
    read = {n: _metric(servers[n].url, "vllm_neuron:kv_transfer_blocks_total") - before[n] for n in ("d1", "d2")}
    assert read["d1"] > 0 and read["d2"] > 0  # both decode instances served (TP=2 and TP=1), from read blocks
    for n in ("d1", "d2"):
        assert _metric(servers[n].url, "vllm_neuron:kv_transfer_recomputed_total") == 0
    proxy_metrics = httpx.get(proxy.url + "/metrics").text
    assert 'vllm_neuron_proxy:requests_total{kind="prefill"' in proxy_metrics


def test_streamed_chat_through_the_proxy_equals_a_single_server(fleet):
    servers, _ = fleet
    body = {"messages": [{"role": "user", "content": "Tell me about the sea, the sky and the ships " * 3}],
            "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
    single = httpx.post(servers["d2"].url + "/v1/chat/completions", json=body, timeout=120).json()
    text = ""
    with httpx.stream("POST", servers["proxy"].url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"]
                text += delta[0]["delta"].get("content") or "" if delta else ""
    assert text == single["choices"][0]["message"]["content"] and text


def test_vllm_protocol_field_for_field(fleet, reference):
    servers, _ = fleet
    toy = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
           "remote_host": None, "remote_port": None}
    r = _complete(servers["p1"].url, PROMPTS[2], max_tokens=1, stream=False, kv_transfer_params=toy)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_host"] == "127.0.0.1" and isinstance(params["remote_port"], int)
    assert len(params["remote_block_ids"]) == 5 and params["remote_engine_id"].startswith("vllm-neuron-")
    assert _metric(servers["p1"].url, "vllm_neuron:kv_transfer_held_blocks") == 5
    d = _complete(servers["d2"].url, PROMPTS[2], kv_transfer_params=params)
    assert d.status_code == 200 and d.json()["choices"][0]["token_ids"] == reference[2]
    wait_for(lambda: _metric(servers["p1"].url, "vllm_neuron:kv_transfer_held_blocks") == 0, 5,
             what="the held blocks released by the reader")


def test_forged_and_stale_params_fall_back_to_a_local_prefill(fleet, reference):
    servers, _ = fleet
    d2 = servers["d2"].url
    toy = {"do_remote_decode": True}
    good = _complete(servers["p2"].url, PROMPTS[1], max_tokens=1, kv_transfer_params=toy).json()["kv_transfer_params"]
    recomputed = _metric(d2, "vllm_neuron:kv_transfer_recomputed_total")
    # Without the hold's secret nothing is read or released: not with the right blocks, not from the right place.
    stranger = {**good, "remote_secret": "0" * 32}
    forged = [stranger, {**stranger, "remote_block_ids": [60, 61, 62]}, {**good, "remote_engine_id": "someone-else"},
              {**good, "remote_port": free_port()}, {**good, "remote_host": "127.0.0.2"}]
    for params in forged:
        r = _complete(d2, PROMPTS[1], kv_transfer_params=params)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference[1], r.text
    assert _metric(d2, "vllm_neuron:kv_transfer_recomputed_total") == recomputed + len(forged)
    # The real reader still gets the held blocks, then releases them.
    r = _complete(d2, PROMPTS[1], kv_transfer_params=good)
    assert r.json()["choices"][0]["token_ids"] == reference[1]
    assert _metric(d2, "vllm_neuron:kv_transfer_recomputed_total") == recomputed + len(forged)
    # Block ids of another request (or none), with this hold's secret: refused by the holder, prefilled here.
    good = _complete(servers["p2"].url, PROMPTS[0], max_tokens=1, kv_transfer_params=toy).json()["kv_transfer_params"]
    r = _complete(d2, PROMPTS[0], kv_transfer_params={**good, "remote_block_ids": [60, 61]})
    assert r.json()["choices"][0]["token_ids"] == reference[0]
    assert _metric(d2, "vllm_neuron:kv_transfer_recomputed_total") == recomputed + len(forged) + 1
    for params, param in [({"remote_port": "x", "do_remote_prefill": True}, "kv_transfer_params"),
                          ([1], "kv_transfer_params")]:
        r = _complete(d2, PROMPTS[0], kv_transfer_params=params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = _complete(servers["p1"].url, PROMPTS[0], kv_transfer_params=toy, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_unread_blocks_are_freed_after_the_hold_timeout(fleet):
    servers, _ = fleet
    p1 = servers["p1"].url
    expired = _metric(p1, "vllm_neuron:kv_transfer_hold_expired_total")
    r = _complete(p1, PROMPTS[3], max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 200 and _metric(p1, "vllm_neuron:kv_transfer_held_blocks") == 3
    assert _metric(p1, "vllm:kv_cache_usage_perc") > 0
    wait_for(lambda: _metric(p1, "vllm_neuron:kv_transfer_hold_expired_total") == expired + 1, HOLD_S + 5,
             what="the hold timeout")
    assert _metric(p1, "vllm_neuron:kv_transfer_held_blocks") == 0  # the pool check follows (autouse fixture)


def test_a_dead_prefill_instance_is_skipped(fleet, reference):
    servers, tmp = fleet
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = Proxy([dead, servers["p1"].url], [servers["d2"].url], tmp)
    try:
        for i in (0, 2):
            r = _complete(proxy.url, PROMPTS[i])
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference[i], r.text
        assert f'vllm_neuron_proxy:failures_total{{kind="prefill",url="{dead}"}} 1.0' in httpx.get(
            proxy.url + "/metrics").text
        # Every prefill instance gone: the decode instance prefills the request itself.
        servers["p1"].kill()
        r = _complete(proxy.url, PROMPTS[3])
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference[3], r.text
        assert "vllm_neuron_proxy:prefill_fallbacks_total 1.0" in httpx.get(proxy.url + "/metrics").text
    finally:
        proxy.stop()
