"""--scheduling-policy priority end to end: the offline engine (tokenizer, EngineCore, scheduler, runner) with
one sequence at a time, so every request but the first waits in a full batch; they finish in priority order
(lower first, ties by arrival), and LLM.generate takes vLLM's per-prompt `priority` list."""
from __future__ import annotations

import pytest

from tests.model_factory import tiny_llm
from vllm_neuron import SamplingParams
from vllm_neuron.sampling_params import RequestOutputKind

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return tiny_llm(tiny_llama_dir, max_num_seqs=1, scheduling_policy="priority")


def test_requests_finish_in_priority_order_under_a_full_batch(llm):
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for rid, prio in [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", -1)]:
        engine.add_request(rid, f"request {rid} says", params, prio)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["e", "b", "d", "c", "a"]


def test_llm_generate_takes_a_priority_per_prompt(llm):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plain = llm.generate(["one two", "three four"], params, use_tqdm=False)
    ranked = llm.generate(["one two", "three four"], params, use_tqdm=False, priority=[5, -5])
    # Outputs stay in prompt order whatever ran first, and greedy tokens do not depend on the order.
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in plain]
    with pytest.raises(ValueError, match="2 prompts but 1 priorities"):
        llm.generate(["one", "two"], params, priority=[1])
    with pytest.raises(ValueError, match="priority must be an integer"):
        llm.generate(["one"], params, priority=["high"])
