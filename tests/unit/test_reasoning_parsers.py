"""The `<think>` reasoning parsers (vllm_neuron/reasoning): where the reasoning starts and ends, and
streamed deltas of any size adding up to the non-streamed split."""
from __future__ import annotations

import pytest

from vllm_neuron.reasoning import ReasoningDelta, ReasoningParserManager


def streamed(name: str, prompt: str, text: str, step: int) -> ReasoningDelta:
    parser = ReasoningParserManager.get(name)(None)
    parser.start(prompt)
    out = ReasoningDelta()
    for i in range(0, len(text), step):
        out = out + parser.feed(text[i:i + step])
    return out + parser.finish()


CASES = [
    # (parser, prompt, output, reasoning, content)
    ("qwen3", "assistant\n", "<think>\nplan</think>\n\nanswer", "\nplan", "\n\nanswer"),
    ("qwen3", "assistant\n", "plain answer <think> not a tag", "", "plain answer <think> not a tag"),
    ("qwen3", "assistant\n", "<think>cut sh", "cut sh", ""),
    ("qwen3", "assistant\n<think>\n", "opened by the template</think>ok", "opened by the template", "ok"),
    ("qwen3", "assistant\n<think>\n\n</think>\n\n", "<think>is content", "", "<think>is content"),
    ("deepseek_r1", "Assistant:", "no start tag</think>done", "no start tag", "done"),
    ("deepseek_r1", "Assistant:", "<think>all thinking", "all thinking", ""),
    ("deepseek_r1", "Assistant:", "a </thi", "a </thi", ""),
]


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_split_at_every_chunk_size(name, prompt, text, reasoning, content):
    whole = ReasoningParserManager.get(name)(None).split(prompt, text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for step in range(1, len(text) + 1):
        assert streamed(name, prompt, text, step) == whole


def test_partial_tag_is_held_back_until_it_resolves():
    parser = ReasoningParserManager.get("qwen3")(None)
    parser.start("")
    assert parser.feed("<thi") == ReasoningDelta()
    assert parser.feed("nk>a</th") == ReasoningDelta(reasoning="a")
    assert not parser.reasoning_done
    assert parser.feed("ink>b") == ReasoningDelta(content="b") and parser.reasoning_done


def test_unknown_parser_names_the_valid_ones():
    with pytest.raises(ValueError, match="deepseek_r1, openai_gptoss, qwen3"):
        ReasoningParserManager.get("nope")
