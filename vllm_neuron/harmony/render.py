"""Chat requests as harmony conversations (openai-harmony renders them): the system message (reasoning
effort, today's date, as vLLM's), the request's system / developer messages as developer instructions with
the function tools, user turns, assistant turns (reasoning on the analysis channel, tool calls on the
commentary channel to `functions.NAME`, the answer on the final channel) and tool results.
"""
from __future__ import annotations

import datetime
import json
from typing import Any


EFFORTS = ("low", "medium", "high")


class BadRequestError(ValueError):
    """A request harmony cannot render; `param` names the field (the server's 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequestError(f"{where}.content[{j}]: harmony (gpt-oss) takes text parts only.",
                                      param=f"{where}.content[{j}]")
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadRequestError(f"{where}.content must be a string or a list of text parts.", param=f"{where}.content")


def _calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, each {"function": {"name": str, "arguments": ...}} (400 otherwise)."""
    if calls is None:
        return []
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
        for c in calls)
    if not ok:
        raise BadRequestError(f"{where}.tool_calls must be a list of {{\"id\": ..., \"function\": {{\"name\": ..., "
                              "\"arguments\": ...}}}} objects.", param=f"{where}.tool_calls")
    return calls


def tool_descriptions(tools: list[dict[str, Any]] | None) -> list[Any]:
    from openai_harmony import ToolDescription

    out = []
    for tool in tools or []:
        fn = tool.get("function") or {}
        out.append(ToolDescription.new(fn["name"], fn.get("description") or "", parameters=fn.get("parameters")))
    return out


def conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 reasoning_effort: str | None, today: str | None = None) -> Any:
    """The harmony Conversation of a chat request (tools None: none are offered)."""
    from openai_harmony import (Author, Conversation, DeveloperContent, Message, ReasoningEffort, Role,
                                SystemContent)

    if reasoning_effort is not None and reasoning_effort not in EFFORTS:
        raise BadRequestError(f"reasoning_effort {reasoning_effort!r} is not valid; valid values: "
                              f"{', '.join(EFFORTS)}.", param="reasoning_effort")
    system = SystemContent.new().with_conversation_start_date(today or datetime.date.today().isoformat())
    if reasoning_effort is not None:
        system = system.with_reasoning_effort(ReasoningEffort(reasoning_effort.capitalize()))
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    instructions = [_text(m.get("content"), f"messages[{i}]") for i, m in enumerate(messages)
                    if m.get("role") in ("system", "developer")]
    described = tool_descriptions(tools)
    if instructions or described:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions("\n\n".join(instructions))
        if described:
            dev = dev.with_function_tools(described)
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    call_names: dict[str, str] = {}
    for i, msg in enumerate(messages):
        role, where = msg.get("role"), f"messages[{i}]"
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, _text(msg.get("content"), where)))
        elif role == "assistant":
            reasoning = msg.get("reasoning_content") or msg.get("reasoning")
            if reasoning:
                if not isinstance(reasoning, str):
                    raise BadRequestError(f"{where}.reasoning_content must be a string.",
                                          param=f"{where}.reasoning_content")
                out.append(Message.from_role_and_content(Role.ASSISTANT, reasoning).with_channel("analysis"))
            for j, call in enumerate(_calls(msg.get("tool_calls"), where)):
                fn = call["function"]
                args = fn.get("arguments")
                args = args if isinstance(args, str) else json.dumps(args)
                if isinstance(call.get("id"), str):
                    call_names[call["id"]] = fn["name"]
                out.append(Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
                           .with_recipient(f"functions.{fn.get('name')}").with_content_type("<|constrain|>json"))
            content = _text(msg.get("content"), where)
            if content:
                out.append(Message.from_role_and_content(Role.ASSISTANT, content).with_channel("final"))
        elif role == "tool":
            call_id = msg.get("tool_call_id")
            name = msg.get("name") or (call_names.get(call_id) if isinstance(call_id, str) else None)
            if not isinstance(name, str) or not name:
                raise BadRequestError(f"{where}: a tool message needs the `tool_call_id` of an earlier call (or "
                                      "`name`).", param=f"{where}.tool_call_id")
            out.append(Message.from_author_and_content(Author.new(Role.TOOL, f"functions.{name}"),
                                                       _text(msg.get("content"), where))
                       .with_channel("commentary").with_recipient("assistant"))
        else:
            raise BadRequestError(f"{where}.role {role!r} is not valid; valid roles: system, developer, user, "
                                  "assistant, tool.", param=f"{where}.role")
    return Conversation.from_messages(out)


def prefill(tool_mode: str, name: str | None) -> str:
    """The start of the answer a tool_choice fixes (the model writes the rest): a call to the named function,
    or to some function for "required"."""
    if tool_mode == "named":
        return f"<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
    if tool_mode == "required":
        return "<|channel|>commentary to=functions."
    return ""
