"""/v1/responses requests -> chat requests (entrypoints/openai/responses_input.py): input items, tools,
tool_choice, text.format, and the 400s for what the server cannot honour."""
from __future__ import annotations

import pytest

from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.entrypoints.openai.responses_input import (ResponsesRequest, chat_request, check_unsupported,
                                                            input_messages)
from vllm_neuron.entrypoints.openai.responses_store import ResponseStore, StoredResponse


def test_input_items_become_chat_messages():
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "be terse"}]},
        {"type": "message", "role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "look"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
    ]
    msgs = input_messages(items)
    assert msgs[0] == {"role": "developer", "content": [{"type": "text", "text": "be terse"}]}
    assert msgs[1] == {"role": "user", "content": "weather?"}
    assert msgs[2]["role"] == "assistant" and msgs[2]["reasoning_content"] == "look"
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]  # one turn, both calls
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": "rain"}
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


def test_request_fields_map_to_chat_fields():
    data = {"input": "x", "instructions": "sys", "max_output_tokens": 7, "reasoning": {"effort": "low"},
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"}, "seed": 3, "stream": True,
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}}
    req = ResponsesRequest.model_validate(data)
    chat = chat_request(req, data, [{"role": "user", "content": "before"}], input_messages(req.input))
    assert [m["content"] for m in chat["messages"]] == ["sys", "before", "x"]
    assert chat["max_completion_tokens"] == 7 and chat["reasoning_effort"] == "low" and chat["seed"] == 3
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "s",
                                                                             "schema": {"type": "object"}}}
    assert chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("data,param", [
    ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": []}]}, "tools[0].type"),
    ({"tool_choice": {"type": "web_search"}, "tools": [{"type": "function", "name": "f"}]}, "tool_choice"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
])
def test_unsupported_is_a_400_naming_it(data, param):
    req = ResponsesRequest.model_validate({"input": "x", **data})
    with pytest.raises(BadRequestError) as e:
        chat_request(req, data, [], input_messages(req.input))
    assert e.value.param == param


def test_background_and_conversations_are_refused():
    for data, param in (({"background": True}, "background"), ({"conversation": "c"}, "conversation")):
        with pytest.raises(BadRequestError) as e:
            check_unsupported(data)
        assert e.value.param == param


def test_store_is_bounded_and_off_at_zero():
    store = ResponseStore(2)
    for i in range(3):
        store.put(f"r{i}", StoredResponse({"id": f"r{i}"}, []))
    assert store.get("r0") is None and store.get("r2").response == {"id": "r2"} and len(store) == 2
    off = ResponseStore(0)
    off.put("r", StoredResponse({}, []))
    assert not off.enabled and off.get("r") is None


def test_include_values_that_change_the_output_are_refused():
    check_unsupported({"include": ["reasoning.encrypted_content"]})
    with pytest.raises(BadRequestError) as e:
        check_unsupported({"include": ["message.output_text.logprobs"]})
    assert e.value.param == "include"
