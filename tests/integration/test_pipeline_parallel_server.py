"""`serve -pp 2` as real processes over two "nodes" on loopback (a head with the API server and stage 0, a
`--headless` process tree with stage 1): the CLI flags and the multi-node rank arithmetic end to end, greedy text
equal to one process's, and stage 1 killed mid-request fails the request with an error and the server exits
unhealthy (code 1, "The engine process died"), each in bounded time."""
from __future__ import annotations

import signal

import pytest

from tests.integration.server_utils import rank_children, two_loopback_nodes
from tests.integration.test_tensor_parallel_server import PROMPT, _complete, _fail_rank_mid_request
from tests.model_factory import tiny_llm
from vllm_neuron import SamplingParams

pytestmark = pytest.mark.engine

COMMON = ["--enforce-eager", "-pp", "2", "--max-model-len", "256", "--dtype", "float32", "--device", "cpu",
          "--num-gpu-blocks-override", "64", "--disable-log-stats"]


def test_two_stage_server_on_two_nodes_and_a_dead_stage_fails_fast(tiny_llama_dir, tmp_path):
    llm = tiny_llm(tiny_llama_dir)  # one process, one stage: the text the pipeline must give
    try:
        params = SamplingParams(temperature=0.0, max_tokens=PROMPT["max_tokens"], ignore_eos=True)
        expected = llm.generate(PROMPT["prompt"], params, use_tqdm=False)[0].outputs[0].text
    finally:
        llm.llm_engine.shutdown()
    with two_loopback_nodes(tiny_llama_dir, COMMON, tmp_path, VLLM_NEURON_DIST_TIMEOUT_S="10") as (head, follower):
        head.wait_healthy(300)
        assert _complete(head) == expected, "two stages and one gave different greedy text"
        (stage1,) = rank_children(follower.pid)
        # Stage 1 lives in the other process tree: the head learns of its death through the broken pipe only.
        _fail_rank_mid_request(head, stage1, signal.SIGKILL)
    log = head.log()
    assert "2 pipeline stage(s) of 1" in log, log[-3000:]
    node1 = (tmp_path / "node1.log").read_text(errors="replace")
    assert "Headless node 1: tensor parallel ranks 1..1 (of 2: 2 pipeline stage(s)" in node1, node1[-2000:]
