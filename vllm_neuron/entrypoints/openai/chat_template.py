"""Chat template rendering: the --chat-template option, OpenAI messages in the shape templates
expect, and the rendered prompt text. Rendering is blocking work (a template may loop): the
serving classes run it in their worker threads, never on the event loop.
"""
from __future__ import annotations

import json
import os
from typing import Any

from vllm_neuron.entrypoints.openai.errors import BadRequestError


def load_chat_template(template: str | None) -> str | None:
    """--chat-template is a file path or the template itself (vLLM's rule)."""
    if template is None:
        return None
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if any(c in template for c in "{}\n"):
        return template
    raise ValueError(f"--chat-template {template!r} is neither an existing file nor a Jinja template")


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Turns OpenAI messages into what chat templates expect: text content as one string."""
    if not messages:
        raise BadRequestError("`messages` must contain at least one message.", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequestError(f"messages[{i}] must be an object with a string `role`.",
                                  param=f"messages[{i}].role")
        msg = dict(msg)
        if msg["role"] == "assistant" and isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_template_tool_call(tc) for tc in msg["tool_calls"]]
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise BadRequestError(f"Content part type {kind!r} is not supported; only 'text' parts are.",
                                          param=f"messages[{i}].content[{j}].type")
                texts.append(part["text"])
            msg["content"] = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise BadRequestError(f"messages[{i}].content must be a string or a list of content parts.",
                                  param=f"messages[{i}].content")
        out.append(msg)
    return out


def _template_tool_call(tool_call: Any) -> Any:
    # OpenAI sends arguments as JSON text; chat templates iterate over them as a mapping.
    fn = tool_call.get("function") if isinstance(tool_call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            return tool_call
        if isinstance(args, dict):
            return {**tool_call, "function": {**fn, "arguments": args}}
    return tool_call


def render_chat(tokenizer: Any, messages: list[Any], *, template: str | None, add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict[str, Any] | None = None,
                documents: list[dict[str, str]] | None = None, tools: list[dict] | None = None) -> str:
    """The prompt text of a conversation; any template failure is the request's fault (400)."""
    msgs = normalize_messages(messages)
    if continue_final_message and msgs[-1].get("role") != "assistant":
        raise BadRequestError("continue_final_message requires the last message to be from the assistant.",
                              param="continue_final_message")
    kwargs = dict(template_kwargs or {})
    for reserved in ("conversation", "messages", "tokenize", "chat_template"):
        kwargs.pop(reserved, None)
    try:
        text = tokenizer.apply_chat_template(
            msgs, chat_template=template, tools=tools, documents=documents, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **kwargs)
    except Exception as e:  # jinja2 errors, missing template, bad message shapes
        raise BadRequestError(f"Chat template error: {type(e).__name__}: {e}", param="messages") from None
    if not isinstance(text, str):
        raise BadRequestError("Chat template did not render to a string.", param="chat_template")
    return text

