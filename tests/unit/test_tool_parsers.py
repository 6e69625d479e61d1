"""Tool-call parsers (hermes, llama3_json) on canned model texts, finished and streamed in random chunk
sizes; the JSON call scanner; tool_choice resolution and its grammars."""
from __future__ import annotations

import json
import random

import pytest

from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.entrypoints.openai.tool_calls import ToolCallStream, extract_final, resolve_tool_choice
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.tool_parsers import JsonCallScanner, ToolParserManager

WEATHER_ARGS = {"city": "Paris", "units": ["c", {"note": "}]\"<tool_call>{"}], "days": 3}
HERMES = ("Let me look that up.\n<tool_call>\n"
          + json.dumps({"name": "get_weather", "arguments": WEATHER_ARGS})
          + "\n</tool_call>\n<tool_call>\n{\"arguments\": {\"q\": \"x\"}, \"name\": \"search\"}\n</tool_call>")
LLAMA3 = ('<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER_ARGS)
          + '}; {"name": "now", "arguments": {}}')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]


def stream_all(feed, finish, text: str, seed: int):
    """Feeds `text` in random chunks; returns (content, {index: {"id", "name", "arguments"}}, headers)."""
    rng = random.Random(seed)
    deltas, pos = [], 0
    while pos < len(text):
        n = rng.randint(1, 7)
        deltas.append(feed(text[pos:pos + n]))
        pos += n
    deltas.append(finish())
    content, calls = "", {}
    for d in deltas:
        content += d.content or ""
        for tc in d.tool_calls:
            as_dict = tc.to_dict()
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if "id" in as_dict:
                # The first delta of a call carries id, type and name; later ones only arguments.
                assert call["id"] is None and as_dict["type"] == "function" and as_dict["function"]["name"]
                call["id"], call["name"] = as_dict["id"], as_dict["function"]["name"]
            else:
                assert call["id"] is not None, "arguments streamed before the call's header"
                assert "name" not in as_dict.get("function", {})
            call["arguments"] += as_dict.get("function", {}).get("arguments", "")
    return content, calls


# ---- hermes ------------------------------------------------------------------------------------------

def test_hermes_finished_text():
    parser = ToolParserManager.get("hermes")()
    found = parser.extract_tool_calls(HERMES)
    assert found.tools_called and found.content == "Let me look that up.\n"
    assert [c.function.name for c in found.tool_calls] == ["get_weather", "search"]
    assert json.loads(found.tool_calls[0].function.arguments) == WEATHER_ARGS
    assert json.loads(found.tool_calls[1].function.arguments) == {"q": "x"}
    assert len({c.id for c in found.tool_calls}) == 2
    # Without calls, or with a block that is not a call, everything is content.
    for text in ("Just words, no tools.", "<tool_call>\nnot json\n</tool_call>", '<tool_call>{"x": 1}</tool_call>'):
        found = parser.extract_tool_calls(text)
        assert not found.tools_called and found.content == text and found.tool_calls == []
    # A block cut off by max_tokens after complete JSON still counts.
    found = parser.extract_tool_calls('<tool_call>{"name": "now", "arguments": {}}')
    assert found.tools_called and found.content is None and found.tool_calls[0].function.arguments == "{}"


@pytest.mark.parametrize("seed", range(6))
def test_hermes_streaming_matches_finished(seed):
    parser = ToolParserManager.get("hermes")()
    content, calls = stream_all(parser.extract_tool_calls_streaming, parser.finish_streaming, HERMES, seed)
    assert parser.tools_called
    assert content == "Let me look that up.\n"  # the marker and the blocks never leak into content
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "search"]
    assert json.loads(calls[0]["arguments"]) == WEATHER_ARGS
    assert json.loads(calls[1]["arguments"]) == {"q": "x"}


def test_hermes_streaming_plain_text_and_partial_marker():
    parser = ToolParserManager.get("hermes")()
    text = "A <tool that is not a marker <tool_cal"
    content, calls = stream_all(parser.extract_tool_calls_streaming, parser.finish_streaming, text, 1)
    assert content == text and calls == {} and not parser.tools_called


def test_hermes_keeps_special_tokens():
    sp = SamplingParams()
    ToolParserManager.get("hermes")().adjust_request(sp)
    assert sp.skip_special_tokens is False


# ---- llama3_json -------------------------------------------------------------------------------------

def test_llama3_finished_text():
    parser = ToolParserManager.get("llama3_json")()
    found = parser.extract_tool_calls(LLAMA3)
    assert found.tools_called and found.content is None
    assert [c.function.name for c in found.tool_calls] == ["get_weather", "now"]
    assert json.loads(found.tool_calls[0].function.arguments) == WEATHER_ARGS
    assert json.loads(found.tool_calls[1].function.arguments) == {}
    found = parser.extract_tool_calls('  {"name": "now", "parameters": {"tz": "UTC"}}')
    assert found.tools_called and json.loads(found.tool_calls[0].function.arguments) == {"tz": "UTC"}
    for text in ("The weather is fine.", '{"no_name": 1}', '{"name": "f", "parameters": {}} trailing words'):
        found = parser.extract_tool_calls(text)
        assert not found.tools_called and found.content == text


@pytest.mark.parametrize("seed", range(4))
def test_llama3_streaming_matches_finished(seed):
    parser = ToolParserManager.get("llama3_json")()
    content, calls = stream_all(parser.extract_tool_calls_streaming, parser.finish_streaming, LLAMA3, seed)
    assert content == "" and parser.tools_called
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "now"]
    assert json.loads(calls[0]["arguments"]) == WEATHER_ARGS and json.loads(calls[1]["arguments"]) == {}


@pytest.mark.parametrize("text", ["  Paris is sunny {really}.", "<|python", " "])
def test_llama3_streaming_content(text):
    parser = ToolParserManager.get("llama3_json")()
    content, calls = stream_all(parser.extract_tool_calls_streaming, parser.finish_streaming, text, 3)
    assert content == text and calls == {} and not parser.tools_called


def test_registry():
    assert {"hermes", "llama3_json"} <= set(ToolParserManager.names())
    with pytest.raises(ValueError, match="valid parsers: .*hermes.*llama3_json"):
        ToolParserManager.get("nope")


# ---- the JSON call scanner ----------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ('{"name": "f", "arguments": {"a": "}{"}}', [("f", {"a": "}{"})]),
    ('{"arguments": [1, {"b": null}], "name": "g"}', [("g", [1, {"b": None}])]),
    ('{"name": "h"}', [("h", {})]),
    ('{"name": "s", "arguments": "{\\"x\\": 1}"}', [("s", {"x": 1})]),  # arguments as JSON text
    ('{"name": "n", "arguments": 5 }; {"name": "m", "parameters": {"k": true}}', [("n", 5), ("m", {"k": True})]),
])
def test_scanner_top_level_calls(text, expected):
    for seed in range(3):
        scanner = JsonCallScanner()
        _, calls = stream_all(lambda d, s=scanner: _wrap(s.feed(d)), lambda s=scanner: _wrap(s.finish()), text, seed)
        assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == expected


def _wrap(tool_calls):
    from vllm_neuron.tool_parsers import StreamDelta

    return StreamDelta(tool_calls=tool_calls)


def test_scanner_streams_arguments_while_written():
    scanner = JsonCallScanner(call_depth=1, args_keys=("parameters",))
    first = scanner.feed('[{"name": "get_weather", "parameters": {"city": "Pa')
    assert len(first) == 1 and first[0].function.name == "get_weather"
    assert first[0].function.arguments == '{"city": "Pa'  # not held until the value ends
    more = scanner.feed('ris"}}, {"name": "now", "parameters": {}}]')
    args = {d.index: d.function.arguments for d in more}
    assert args[0] == 'ris"}' and more[-1].function.name == "now" and args[1] == "{}"


# ---- tool_choice ----------------------------------------------------------------------------------------

class _Parser:
    pass


@pytest.mark.parametrize("tools,choice,parser,param,needle", [
    (TOOLS, None, None, "tools", "--enable-auto-tool-choice and --tool-call-parser"),
    (TOOLS, "auto", None, "tool_choice", "--enable-auto-tool-choice and --tool-call-parser"),
    (None, "required", None, "tool_choice", "`tools` must be set"),
    (TOOLS, {"type": "function", "function": {"name": "other"}}, None, "tool_choice", "'other' has not been passed"),
    (TOOLS, "sometimes", None, "tool_choice", "is not valid"),
    ([{"type": "function", "function": {"description": "no name"}}], "required", None, "tools[0]", "name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "required", None,
     "tools[0].function.parameters", "JSON schema object"),
])
def test_tool_choice_errors(tools, choice, parser, param, needle):
    with pytest.raises(BadRequestError) as e:
        resolve_tool_choice(tools, choice, True, parser)
    assert e.value.param == param and needle in str(e.value)


def test_tool_choice_modes(tokenizer_info):
    from vllm_neuron.structured_output.compiler import validate

    assert resolve_tool_choice(None, None, True, None).mode == "none"
    assert resolve_tool_choice(TOOLS, "none", True, None).mode == "none"
    assert resolve_tool_choice(TOOLS, None, True, _Parser).mode == "auto"
    required = resolve_tool_choice(TOOLS, "required", True, None)
    schema = required.structured_outputs.json
    assert required.mode == "required" and schema["minItems"] == 1 and "maxItems" not in schema
    assert resolve_tool_choice(TOOLS, "required", False, None).structured_outputs.json["maxItems"] == 1
    validate(required.structured_outputs, tokenizer_info)
    named = resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True, None)
    assert named.mode == "named" and named.name == "get_weather"
    assert named.structured_outputs.json == TOOLS[0]["function"]["parameters"]


@pytest.fixture(scope="module")
def tokenizer_info(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    from vllm_neuron.structured_output.compiler import make_tokenizer_info

    return make_tokenizer_info(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir))


def test_required_and_named_outputs_become_calls():
    required = resolve_tool_choice(TOOLS, "required", True, None)
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "now", "parameters": {}}]'
    found = extract_final(required, text, None)
    assert found.tools_called and found.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in found.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("now", {})]
    for seed in range(3):
        stream = ToolCallStream(required, None)
        content, calls = stream_all(stream.feed, stream.finish, text, seed)
        assert content == "" and stream.tools_called
        assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
            ("get_weather", {"city": "Oslo"}), ("now", {})]
    # Cut short by max_tokens: not a call, the text stays content.
    cut = extract_final(required, text[:30], None)
    assert not cut.tools_called and cut.content == text[:30]

    named = resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True, None)
    found = extract_final(named, '{"city": "Lima"}', None)
    assert found.tools_called and found.tool_calls[0].function.name == "get_weather"
    assert json.loads(found.tool_calls[0].function.arguments) == {"city": "Lima"}
    stream = ToolCallStream(named, None)
    content, calls = stream_all(stream.feed, stream.finish, '{"city": "Lima"}', 0)
    assert content == "" and calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {
        "city": "Lima"}
