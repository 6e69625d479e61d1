"""One request's failure inside the engine core costs that request only (issue 19).

A failure is injected into the per-request setup of the model runner (its sampling state), with
and without async scheduling: the poisoned request finishes with "error", requests running beside
it produce exactly the tokens they produce alone (they are rolled back and recomputed), and the
engine serves the next request. A seed outside 64 bits, the probe's process killer, is refused
where it enters (SamplingParams) and, smuggled past that check, still costs only its request.
"""
from __future__ import annotations

import pytest

from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.engine.llm_engine import LLMEngine
from vllm_neuron.sampling_params import SamplingParams

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=[(False, "0"), (True, "0"), (True, "1")],
                ids=["mrv1-sync", "mrv1-async", "mrv2-async"])
def engine(tiny_llama_dir, request) -> LLMEngine:
    async_scheduling, use_v2 = request.param
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", use_v2)  # eager alone would pick MRv1
        engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(
            model=tiny_llama_dir, enforce_eager=True, max_model_len=256, max_num_seqs=4, dtype="float32",
            num_gpu_blocks_override=64, block_size=16, async_scheduling=async_scheduling))
    assert engine.config.use_v2_model_runner == (use_v2 == "1")
    return engine


def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]], join_after: int = 0,
         late: dict[str, tuple[str, SamplingParams]] | None = None) -> dict:
    """Runs `requests`, adding `late` ones after `join_after` steps; returns id -> final output."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests() or late:
        if late and steps >= join_after:
            for rid, (prompt, params) in late.items():
                engine.add_request(rid, prompt, params)
            late = None
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        assert steps < 500, "the engine stopped making progress"
    return done


def test_injected_per_request_failure_costs_one_request(engine, monkeypatch):
    alone = _run(engine, {"a": ("The quick brown fox", GREEDY)})["a"].outputs[0].token_ids
    c_alone = _run(engine, {"c0": ("Once upon a time", GREEDY)})["c0"].outputs[0].token_ids
    assert len(alone) == 10
    sampling = engine.core.runner.sampling
    real_add = sampling.add

    def add(data):
        if data.req_id.startswith("poison"):
            raise RuntimeError("injected failure in a request's setup")
        return real_add(data)

    monkeypatch.setattr(sampling, "add", add)
    done = _run(engine, {"a2": ("The quick brown fox", GREEDY)}, join_after=3,
                late={"poison": ("Hello", GREEDY), "c": ("Once upon a time", GREEDY)})
    assert done["poison"].outputs[0].finish_reason == "error"
    assert done["a2"].outputs[0].token_ids == alone, "a request beside the failed one changed its output"
    assert done["a2"].outputs[0].finish_reason == "length"
    # New in the same step as the poison: set up again alone, it must not share the poison's fate.
    assert done["c"].outputs[0].finish_reason == "length" and done["c"].outputs[0].token_ids == c_alone
    monkeypatch.undo()
    again = _run(engine, {"next": ("The quick brown fox", GREEDY)})["next"].outputs[0]
    assert again.token_ids == alone and engine.core.scheduler.kv.usage == 0


def test_out_of_range_seed(engine):
    with pytest.raises(ValueError, match="seed must be a 64-bit"):
        SamplingParams(temperature=1.0, seed=2 ** 64)
    smuggled = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=1)
    smuggled.seed = 2 ** 64  # past the check: the engine must still survive it
    done = _run(engine, {"big-seed": ("Hi", smuggled), "b": ("The quick brown fox", GREEDY)})
    assert done["b"].outputs[0].finish_reason == "length" and len(done["b"].outputs[0].token_ids) == 10
    assert done["big-seed"].finished
    assert _run(engine, {"after": ("Hi", GREEDY)})["after"].outputs[0].finish_reason == "length"


def test_grammar_failure_costs_one_request(engine, monkeypatch):
    from vllm_neuron.structured_output.params import StructuredOutputsParams

    constrained = SamplingParams(temperature=0.0, max_tokens=6,
                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    manager = engine.core._structured()
    real_accept = manager.accept

    def accept(rid, tokens):
        if rid.startswith("poison"):
            raise RuntimeError("injected grammar failure")
        return real_accept(rid, tokens)

    monkeypatch.setattr(manager, "accept", accept)
    done = _run(engine, {"poison-g": ("Answer:", constrained), "ok-g": ("Answer:", constrained),
                         "plain": ("The quick brown fox", GREEDY)})
    assert done["poison-g"].outputs[0].finish_reason == "error"
    assert done["ok-g"].outputs[0].text in ("yes", "no")
    assert done["plain"].outputs[0].finish_reason == "length" and len(done["plain"].outputs[0].token_ids) == 10
