"""`--reasoning-parser qwen3` and `/v1/responses` end to end, on one server of a tiny Qwen3 whose answers a
logits processor forces (tests/forced_output.py), so every field is known exactly.

Chat: non-streamed fields, streamed deltas that add up to them, Qwen3's enable_thinking switch through
chat_template_kwargs, a structured output that starts after the reasoning, a hermes tool call after the
reasoning. Responses (the `openai` SDK's client): output items, the stream's events adding up to the stored
response, a two-turn conversation through previous_response_id (the second prompt holds the first answer), a
function tool round trip, the bounded store, and the 404s and 400s."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.forced_output import SCRIPTS, forced_server, make_tiny_qwen3_thinking
from tests.forced_output import WEATHER_TOOL as WEATHER
from tests.forced_output import chat_forced as chat
from tests.forced_output import stream_forced as streamed

pytestmark = pytest.mark.engine

ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "384", "--num-gpu-blocks-override", "64",
        "--max-num-seqs", "4", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes", "--enable-store", "--responses-store-size", "3"]
WEATHER_FLAT = {"type": "function", "name": "get_weather", "description": "Weather",  # the Responses API's shape
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_qwen3_thinking(str(tmp_path_factory.mktemp("qwen3_think")))


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    with forced_server(model_dir, ARGS, str(tmp_path_factory.mktemp("srv"))) as pair:
        yield pair


@pytest.fixture(scope="module")
def client(served):
    return served[0]


@pytest.fixture(scope="module")
def server(served):
    return served[1]


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
    msg = chat(client, "think_free", response_format=fmt, temperature=1.0, seed=1, max_tokens=40).choices[0].message
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


# ---- /v1/responses ----------------------------------------------------------------------------

def prompt_tokens(model_dir: str, messages: list[dict], **kw) -> int:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)["input_ids"])


def test_reasoning_and_message_items(client):
    res = client.responses.create(model="m", input="force:think", instructions="Be brief.")
    assert res.status == "completed" and [item.type for item in res.output] == ["reasoning", "message"]
    assert res.output[0].content[0].text == "\nLet me count: 1, 2, 3.\n"
    assert res.output_text == "\n\nThe answer is 3."
    assert res.usage.output_tokens > res.usage.output_tokens_details.reasoning_tokens > 0
    assert res.usage.total_tokens == res.usage.input_tokens + res.usage.output_tokens
    short = client.responses.create(model="m", input="force:think", max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_stream_events_add_up_to_the_stored_response(client, server):
    events = list(client.responses.create(model="m", input="force:think", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == "\nLet me count: 1, 2, 3.\n" and text == "\n\nThe answer is 3."
    assert kinds.index("response.output_text.delta") > kinds.index("response.reasoning_text.done")
    done = events[-1].response
    stored = httpx.get(f"{server.url}/v1/responses/{done.id}").json()
    assert stored["output"] == done.model_dump(exclude_unset=True)["output"]
    assert [e.item.id for e in events if e.type == "response.output_item.done"] == [i.id for i in done.output]


def test_previous_response_id_continues_the_conversation(client, model_dir):
    first = client.responses.create(model="m", input="force:nothink first")
    second = client.responses.create(model="m", input="force:nothink second", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.output_text == SCRIPTS["nothink"]
    history = [{"role": "user", "content": "force:nothink first"},
               {"role": "assistant", "content": SCRIPTS["nothink"]},
               {"role": "user", "content": "force:nothink second"}]
    assert second.usage.input_tokens == prompt_tokens(model_dir, history)


def test_function_tool_round_trip(client, model_dir):
    first = client.responses.create(model="m", input="force:think_tool", tools=[WEATHER_FLAT])
    assert [i.type for i in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    events = list(client.responses.create(model="m", input="force:think_tool", tools=[WEATHER_FLAT], stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    assert events[-1].response.output[-1].type == "function_call"
    second = client.responses.create(model="m", previous_response_id=first.id, tools=[WEATHER_FLAT], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        {"role": "user", "content": "force:nothink"}])
    assert second.output_text == SCRIPTS["nothink"]
    # The prompt is the whole exchange: the call, the tool's answer, the new message (and the tools).
    history = [{"role": "user", "content": "force:think_tool"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"},
               {"role": "user", "content": "force:nothink"}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER_FLAT.items() if k != "type"}}]
    assert second.usage.input_tokens == prompt_tokens(model_dir, history, tools=chat_tools)


def test_unknown_ids_bad_tools_and_the_bounded_store(client, server):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="hi", previous_response_id="resp_nope", max_output_tokens=2)
    assert httpx.get(f"{server.url}/v1/responses/resp_nope").status_code == 404
    with pytest.raises(openai.BadRequestError, match="web_search"):
        client.responses.create(model="m", input="hi", tools=[{"type": "web_search"}])
    ids = [client.responses.create(model="m", input="force:nothink").id for _ in range(4)]
    codes = [httpx.get(f"{server.url}/v1/responses/{i}").status_code for i in ids]
    assert codes == [404, 200, 200, 200]  # --responses-store-size 3: the oldest went first
    unstored = client.responses.create(model="m", input="force:nothink", store=False)
    assert unstored.store is False and httpx.get(f"{server.url}/v1/responses/{unstored.id}").status_code == 404
