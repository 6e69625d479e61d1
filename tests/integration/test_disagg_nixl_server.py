"""NixlConnector between real servers (runs only with the optional nixl package installed): a TP=1 prefill
instance and a TP=2 decode instance, so every decode rank READs a slice of the source's heads (per-slot NIXL
descriptors) from another process; greedy fp32 tokens through vLLM's protocol equal transformers', nothing is
recomputed, and the prefill instance's held blocks are released by the reader."""
from __future__ import annotations

import json

import pytest

from tests.integration.server_utils import ServerProcess, free_port, wait_for
from tests.integration.test_disagg_server import ARGS, MAX_NEW, PROMPTS, _complete, _metric
from tests.model_factory import build_tiny_model, greedy_reference
from vllm_neuron.config.kv_transfer import nixl_installed

pytestmark = [pytest.mark.engine, pytest.mark.skipif(
    not nixl_installed(), reason="the optional nixl package is not installed (pip install nixl)")]


def _kv(role: str) -> list[str]:
    return ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role,
                                                "kv_port": free_port()})]


@pytest.fixture(scope="module")
def pair(tiny_llama_dir, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("disagg_nixl"))
    servers = {"p": ServerProcess(tiny_llama_dir, ARGS + _kv("kv_producer"), tmp),
               "d": ServerProcess(tiny_llama_dir, ARGS + ["--tensor-parallel-size", "2"] + _kv("kv_consumer"), tmp)}
    try:
        for srv in servers.values():
            srv.wait_healthy(timeout=180)
        yield servers
    finally:
        for srv in servers.values():
            srv.stop()
            srv.kill()


def test_nixl_tp1_to_tp2_equals_transformers(pair):
    p, d = pair["p"].url, pair["d"].url
    reference = greedy_reference(build_tiny_model("llama"), PROMPTS, MAX_NEW)
    for prompt, want in zip(PROMPTS, reference):
        held = _complete(p, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        assert held.status_code == 200, held.text
        r = _complete(d, prompt, kv_transfer_params=held.json()["kv_transfer_params"])
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
    assert _metric(d, "vllm_neuron:kv_transfer_blocks_total") > 0
    assert _metric(d, "vllm_neuron:kv_transfer_recomputed_total") == 0
    wait_for(lambda: _metric(p, "vllm_neuron:kv_transfer_held_blocks") == 0, 10,
             what="the held blocks released by the reader")
