"""The real bundled model (SmolLM2-135M-Instruct, Q4_1 GGUF) answers a factual question."""
from __future__ import annotations

import pytest

from vllm_neuron import LLM, SamplingParams


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
