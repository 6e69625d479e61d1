"""`--reasoning-parser qwen3` end to end: a tiny Qwen3 whose answers a logits processor forces
(tests/forced_output.py), so every field is known exactly. Non-streamed fields, streamed deltas that add
up to them, Qwen3's enable_thinking switch through chat_template_kwargs, a structured output that starts
after the reasoning, and a hermes tool call after the reasoning."""
from __future__ import annotations

import json

import openai
import pytest

from tests.forced_output import WEATHER_TOOL as WEATHER
from tests.forced_output import chat_forced as chat
from tests.forced_output import stream_forced as streamed
from tests.forced_output import forced_server, make_tiny_qwen3_thinking

pytestmark = pytest.mark.engine

ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64",
        "--max-num-seqs", "4", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes"]


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> openai.OpenAI:
    model = make_tiny_qwen3_thinking(str(tmp_path_factory.mktemp("qwen3_think")))
    with forced_server(model, ARGS, str(tmp_path_factory.mktemp("srv"))) as (client, _srv):
        yield client


def test_thinking_split_streamed_and_not(client):
    msg = chat(client, "think").choices[0].message.model_dump()
    assert msg["reasoning_content"] == msg["reasoning"] == "\nLet me count: 1, 2, 3.\n"
    assert msg["content"] == "\n\nThe answer is 3."
    s = streamed(client, "think")
    assert s["reasoning_content"] == s["reasoning"] == msg["reasoning_content"]
    assert s["content"] == msg["content"] and s["finish"] == "stop"


def test_cut_short_thinking_is_all_reasoning(client):
    msg = chat(client, "cut").choices[0].message.model_dump()
    assert msg["reasoning_content"] == "\nI am still thinking about" and msg["content"] is None
    assert streamed(client, "cut")["reasoning_content"] == msg["reasoning_content"]


def test_enable_thinking_off_reaches_the_template(client):
    on = chat(client, "nothink")
    off = chat(client, "nothink", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # The template closed an empty block in the prompt: the answer is content, with no reasoning.
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    msg = off.choices[0].message.model_dump()
    assert msg["content"] == "The answer is 3." and msg["reasoning_content"] is None
    hidden = chat(client, "think", extra_body={"include_reasoning": False}).choices[0].message.model_dump()
    assert hidden["reasoning_content"] is None and hidden["content"] == "\n\nThe answer is 3."


def test_structured_output_starts_after_the_reasoning(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    for seed in (1, 2):
        msg = chat(client, "think_free", response_format=fmt, temperature=1.0, seed=seed,
                   max_tokens=40).choices[0].message
        assert msg.reasoning_content == "\nJSON with a city.\n"
        assert json.loads(msg.content)["city"] in ("Paris", "Oslo")
    # Unconstrained, the random model writes no such object after the forced reasoning.
    free = chat(client, "think_free", temperature=1.0, seed=1, max_tokens=20).choices[0].message.content
    with pytest.raises(ValueError):
        assert json.loads(free)["city"] in ("Paris", "Oslo")


def test_tool_call_after_reasoning(client):
    res = chat(client, "think_tool", tools=[WEATHER])
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_dump()["reasoning_content"] == "\nI should call the weather tool.\n"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    s = streamed(client, "think_tool", tools=[WEATHER])
    assert s["reasoning_content"] == "\nI should call the weather tool.\n"
    assert [(n, json.loads(a)) for n, a in s["calls"]] == [("get_weather", {"city": "Paris"})]
    assert s["finish"] == "tool_calls"
