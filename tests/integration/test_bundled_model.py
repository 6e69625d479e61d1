"""The real bundled model (SmolLM2-135M-Instruct, Q4_1 GGUF) answers a factual question."""
from __future__ import annotations

import pytest

from vllm_neuron import LLM, SamplingParams

pytestmark = pytest.mark.engine


@pytest.mark.slow
def test_bundled_smollm2_knows_paris():
    llm = LLM(enforce_eager=True, max_model_len=512, max_num_seqs=2, num_gpu_blocks_override=64)
    # The bare question leaves "The" and "L" within 0.08 nats of each other, under bf16's logit
    # resolution: asking for a sentence gives a 1.7-nat margin, so the check tests the model, not rounding.
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}],
                   SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
    text = out.outputs[0].text
    assert "Paris" in text, text
    assert out.outputs[0].finish_reason == "stop"  # the chat model ends its answer with <|im_end|>


def _readme_question() -> str:
    """The question of the README's curl example, so the test and the README cannot drift apart."""
    import os
    import re

    readme = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")
    with open(readme, encoding="utf-8") as f:
        match = re.search(r'"messages": \[\{"role": "user", "content": "([^"]+)"\}\]', f.read())
    assert match, "the README's curl example is gone"
    return match.group(1)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["auto", "float32"])  # float32: what a CPU without AVX512-BF16/AMX runs
def test_readme_question_answered_with_the_default_sampling(dtype):
    """No sampling fields, as in the README: the shipped generation config (the model card's temperature
    0.2 / top_p 0.9, max_new_tokens 256) must give a short, correct answer, whatever the seed."""
    llm = LLM(enforce_eager=True, max_model_len=512, max_num_seqs=2, num_gpu_blocks_override=64, dtype=dtype)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (0.2, 0.9, 256)
    params = []
    for seed in (0, 1):
        p = defaults.clone()
        p.seed = seed
        params.append(p)
    outs = llm.chat([[{"role": "user", "content": _readme_question()}]] * 2, params, use_tqdm=False)
    for out in outs:
        assert "Paris" in out.outputs[0].text, out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) < 40
