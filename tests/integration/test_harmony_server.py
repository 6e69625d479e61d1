"""gpt-oss in harmony end to end (`--reasoning-parser openai_gptoss`): a tiny random gpt-oss with the real
o200k_harmony tokenizer, its answers forced by a logits processor (tests/forced_output.py). Channels as
reasoning and content, tool calls (auto, named, required) streamed and whole, malformed harmony as content,
a structured output after the analysis channel, and the Responses API on top."""
from __future__ import annotations

import json

import openai
import pytest

from tests.forced_output import SCRIPTS, forced_server
from tests.forced_output import WEATHER_TOOL as WEATHER
from tests.forced_output import chat_forced as chat
from tests.forced_output import stream_forced as streamed
from tests.harmony_model import make_tiny_gpt_oss

pytestmark = pytest.mark.engine

ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "96",
        "--max-num-seqs", "4", "--reasoning-parser", "openai_gptoss"]


@pytest.fixture(scope="module")
def client(tmp_path_factory) -> openai.OpenAI:
    model = make_tiny_gpt_oss(str(tmp_path_factory.mktemp("gpt_oss")))
    with forced_server(model, ARGS, str(tmp_path_factory.mktemp("srv"))) as (client, _srv):
        yield client


def test_channels_streamed_and_whole(client):
    res = chat(client, "h_final")
    msg = res.choices[0].message.model_dump()
    assert msg["reasoning_content"] == msg["reasoning"] == "Thinking about it."
    assert msg["content"] == "Hello from gpt-oss!" and not msg["tool_calls"]
    assert res.choices[0].finish_reason == "stop"
    s = streamed(client, "h_final")
    assert (s["reasoning_content"], s["content"], s["finish"]) == ("Thinking about it.", "Hello from gpt-oss!", "stop")


def test_auto_tool_call_streamed_and_whole(client):
    res = chat(client, "h_tool", tools=[WEATHER])
    choice = res.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.model_dump()["reasoning_content"] == \
        "Need the weather."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    s = streamed(client, "h_tool", tools=[WEATHER])
    assert [(n, json.loads(a)) for n, a in s["calls"]] == [("get_weather", {"city": "Paris"})]
    assert s["finish"] == "tool_calls" and s["content"] == ""


def test_named_and_required_tool_choice(client):
    named = chat(client, "h_args", tools=[WEATHER], tool_choice={"type": "function",
                                                                 "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Lima"}
    required = chat(client, "h_pick", tools=[WEATHER], tool_choice="required")
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    s = streamed(client, "h_pick", tools=[WEATHER], tool_choice="required")
    assert [(n, json.loads(a)) for n, a in s["calls"]] == [("get_weather", {"city": "Oslo"})]
    # "none" offers no tools: the prompt is shorter than with them.
    none = chat(client, "h_final", tools=[WEATHER], tool_choice="none")
    assert none.usage.prompt_tokens < chat(client, "h_final", tools=[WEATHER]).usage.prompt_tokens


def test_malformed_harmony_comes_back_as_content(client):
    msg = chat(client, "h_stranger", tools=[WEATHER]).choices[0].message
    assert msg.content == '{"q": 1}' and not msg.tool_calls
    cut = chat(client, "h_final", max_tokens=2).choices[0]
    assert cut.finish_reason == "length" and cut.message.content == "<|channel|>analysis"


def test_structured_output_after_the_analysis(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    msg = chat(client, "h_free", max_tokens=40, temperature=1.0, seed=3, response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}).choices[0].message
    assert msg.model_dump()["reasoning_content"] == "JSON now."
    assert 1 <= json.loads(msg.content)["n"] <= 9


def test_responses_api_on_harmony(client):
    res = client.responses.create(model="m", input="force:h_final", reasoning={"effort": "low"})
    assert [i.type for i in res.output] == ["reasoning", "message"]
    assert res.output[0].content[0].text == "Thinking about it." and res.output_text == "Hello from gpt-oss!"
    assert SCRIPTS["h_final"].endswith(res.output_text + "<|return|>")


def test_what_harmony_cannot_honour_is_a_400(client):
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        chat(client, "h_final", reasoning_effort="extreme")
    with pytest.raises(openai.BadRequestError, match="chat_template"):
        chat(client, "h_final", extra_body={"chat_template": "{{ messages }}"})
    with pytest.raises(openai.BadRequestError, match="enable_thinking"):
        chat(client, "h_final", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # reasoning_effort reaches the system message, from either field.
    def prompt(**kw):
        return chat(client, "h_final", max_tokens=1, extra_body={"return_token_ids": True, **kw}).prompt_token_ids
    low = prompt(reasoning_effort="low")
    assert low == prompt(chat_template_kwargs={"reasoning_effort": "low"}) != prompt(reasoning_effort="high")
