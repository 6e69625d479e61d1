"""AsyncLLM's output loop: a failure that belongs to one request (an error from the engine core,
or one raised while detokenizing its tokens) fails that request only; the others get their outputs."""
from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from vllm_neuron.engine.async_llm import AsyncLLM
from vllm_neuron.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from vllm_neuron.engine.output_processor import OutputProcessor
from vllm_neuron.engine.protocol import EngineRequestError
from vllm_neuron.outputs import RequestOutput
from vllm_neuron.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture
def client(smollm2_tokenizer_dir):
    """An AsyncLLM without its engine process: only the output side is exercised."""
    llm = AsyncLLM.__new__(AsyncLLM)
    llm.output_processor = OutputProcessor(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir))
    llm._queues, llm._dead, llm.sent = {}, None, []
    llm._send = lambda msg, rank: llm.sent.append(msg)
    params = SamplingParams(max_tokens=5, output_kind=RequestOutputKind.DELTA)
    for rid in ("good", "bad"):
        llm.output_processor.add_request(rid, None, [1, 2, 3], params,
                                         [EngineCoreRequest(rid, [1, 2, 3], params, None, 0.0)])
        llm._queues[rid] = asyncio.Queue()
    return llm


def test_detokenizer_error_fails_only_its_request(client):
    def broken(*args, **kwargs):
        raise UnicodeError("injected detokenizer failure")

    client.output_processor.requests["bad"].completions["bad"].detok.update = broken
    queues = dict(client._queues)
    client._dispatch(EngineCoreOutputs([EngineCoreOutput("bad", [42]), EngineCoreOutput("good", [43])]))
    good = queues["good"].get_nowait()
    assert isinstance(good, RequestOutput) and good.outputs[0].token_ids == [43]
    err = queues["bad"].get_nowait()
    assert isinstance(err, EngineRequestError) and "injected detokenizer failure" in str(err)
    assert ("abort", ["bad"]) in client.sent and "bad" not in client.output_processor.requests


def test_engine_error_output_reaches_the_request(client):
    queues = dict(client._queues)
    client._dispatch(EngineCoreOutputs([EngineCoreOutput("bad", [], finish_reason="error", error="boom"),
                                        EngineCoreOutput("good", [43])]))
    assert isinstance(queues["bad"].get_nowait(), EngineRequestError)
    assert isinstance(queues["good"].get_nowait(), RequestOutput)
    assert "good" in client.output_processor.requests


def test_warmup_progress_adds_up_over_the_replicas(client):
    """What the engine cores report of their warm-up, graph by graph (the API server's /health says it)."""
    client._warmup = {}
    assert client.warmup_progress is None
    client._on_message(0, "progress", {"done": 1, "total": 8, "last": "compiled"})
    client._on_message(1, "progress", {"done": 2, "total": 8, "last": "loaded"})
    client._on_message(0, "progress", {"done": 3, "total": 8, "last": "loaded"})
    assert client.warmup_progress == (5, 16)
