"""Async scheduling never changes greedy output, and its batch queue behaves as the seeds describe.

Tiny random Llama, fp32, eager, Model Runner V1 (MRv2's own parity tests cover it with async on).
Requests join and finish mid-stream (staggered arrivals, different max_tokens, EOS-free), so the
async flow breaks and reinstates many times.
"""
from __future__ import annotations

import random

import pytest

from tests.model_factory import make_tiny_llama, tiny_llm
from vllm_neuron import LLM, SamplingParams
from vllm_neuron.engine.core import BATCH_QUEUE_DEPTH
from vllm_neuron.step import PLACEHOLDER_TOKEN_ID

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("async_llama")), max_position_embeddings=512)


def _engine(model_dir: str, async_scheduling: bool, monkeypatch, **kw) -> LLM:
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    return tiny_llm(model_dir, **{"max_model_len": 512, "max_num_batched_tokens": 64, "num_gpu_blocks_override": 256,
                                  "async_scheduling": async_scheduling,
                                  "additional_config": {"neuron_config": {"num_seqs_buckets": [2, 4, 8]}}, **kw})


def _requests(n: int = 9):
    rng = random.Random(1)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 49152) for _ in range(rng.randrange(3, 90))]
        out.append((prompt, SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 14), ignore_eos=True)))
    return out


def _staggered(llm: LLM) -> dict[str, list[int]]:
    """Adds one request every other step, so joins and finishes interleave with running decodes."""
    engine = llm.llm_engine
    pending = list(enumerate(_requests()))
    done: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            i, (prompt, params) = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return done


def test_greedy_identical_with_async_on_and_off(model_dir, monkeypatch):
    sync_out = _staggered(_engine(model_dir, False, monkeypatch))
    llm = _engine(model_dir, True, monkeypatch)
    core = llm.llm_engine.core
    assert core.async_scheduling and not _engine_is_v2(core)
    async_out = _staggered(llm)
    assert async_out == sync_out
    assert len(async_out) == 9 and all(len(v) >= 1 for v in async_out.values())
    # Joins and finishes broke the flow (counted), and the steady state passed tokens without fallback.
    assert core.num_async_sync_fallbacks > 0
    assert core.num_async_passed > 0
    assert not core.has_unfinished() and core.scheduler.kv.pool.num_free_blocks == core.num_blocks - 1


def _engine_is_v2(core) -> bool:
    return type(core.runner).__name__ == "ModelRunnerV2"


def test_async_schedules_one_step_ahead_with_placeholders(model_dir, monkeypatch):
    llm = _engine(model_dir, True, monkeypatch)
    core = llm.llm_engine.core
    seen = []
    execute = core.runner.execute

    def spy(sched):
        seen.append([(c.token_ids[0] == PLACEHOLDER_TOKEN_ID) for c in sched.chunks] if sched.kind == "decode"
                    else None)
        # While a step executes, the engine may already hold the next one: never more than the depth.
        assert len(core._queue) <= BATCH_QUEUE_DEPTH
        return execute(sched)

    core.runner.execute = spy
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}], params,
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    decode_steps = [s for s in seen if s is not None]
    # Every decode step was scheduled before the previous sample reached the host...
    assert decode_steps and all(all(s) for s in decode_steps)
    # ...and no step was wasted past max_tokens: 1 prefill sample + 11 decode samples per request.
    assert len(decode_steps) == 11


def test_stop_token_mid_stream_discards_the_step_scheduled_ahead(model_dir, monkeypatch):
    """A request that stops on a token learned late still returns exactly the tokens up to the stop."""
    sync = _engine(model_dir, False, monkeypatch)
    prompt = {"prompt_token_ids": [11, 12, 13, 14, 15]}
    free = sync.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    stop_at = free[4]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_at])
    expect = sync.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = _engine(model_dir, True, monkeypatch)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == expect and got.token_ids[-1] == stop_at
    assert got.finish_reason == "stop"
