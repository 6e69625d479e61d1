"""Chat template rendering: the --chat-template option, OpenAI messages in the shape templates
expect, and the rendered prompt text. Rendering is blocking work (a template may loop): the
serving classes run it in their worker threads, never on the event loop.
"""
from __future__ import annotations

import base64
import binascii
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


# Media content parts: OpenAI's image_url / video_url / input_audio, vLLM's audio_url (a URL) and offline image /
# image_pil / video / audio (an object or a URL); the template sees {"type": "image" / "video" / "audio"}.
MEDIA_PARTS = {"image_url": "image", "image": "image", "image_pil": "image", "video_url": "video", "video": "video",
               "audio_url": "audio", "input_audio": "audio", "audio": "audio"}


def normalize_messages(messages: list[Any], media: dict[str, list] | None = None) -> list[dict[str, Any]]:
    """Turns OpenAI messages into what chat templates expect: text content as one string, or - when
    `media` is given (a multimodal model) - a list of text and image / video parts, whose sources are
    appended to media["image"] / media["video"] in order."""
    if not messages:
        raise BadRequestError("`messages` must contain at least one message.", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not msg["role"]:
            raise BadRequestError(f"messages[{i}] must be an object with a non-empty string `role`.",
                                  param=f"messages[{i}].role")
        msg = dict(msg)
        if msg["role"] == "assistant" and isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_template_tool_call(tc) for tc in msg["tool_calls"]]
        content = msg.get("content")
        if content is None and not msg.get("tool_calls"):
            # Templates read message.content: without it they fail with a Jinja error that names nothing.
            raise BadRequestError(f"messages[{i}] needs `content` (a string or a list of content parts); only an "
                                  "assistant message with `tool_calls` may leave it out.",
                                  param=f"messages[{i}].content")
        if isinstance(content, list):
            parts = [_content_part(part, media, f"messages[{i}].content[{j}]") for j, part in enumerate(content)]
            msg["content"] = parts if media is not None else "\n".join(p["text"] for p in parts)
        elif content is not None and not isinstance(content, str):
            raise BadRequestError(f"messages[{i}].content must be a string or a list of content parts.",
                                  param=f"messages[{i}].content")
        out.append(msg)
    return out


def _content_part(part: Any, media: dict[str, list] | None, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind not in MEDIA_PARTS:
        raise BadRequestError(f"Content part type {kind!r} is not supported; supported: "
                              f"{['text'] + (list(MEDIA_PARTS) if media is not None else [])}.", param=f"{where}.type")
    if media is None:
        raise BadRequestError(f"Content part type {kind!r} is not supported: this model takes text only.",
                              param=f"{where}.type")
    source = part.get(kind)
    if kind == "input_audio":
        source = _input_audio(source, where)
    elif kind.endswith("_url"):
        source = source.get("url") if isinstance(source, dict) else source
        if not isinstance(source, str):
            raise BadRequestError(f"{where}.{kind}.url must be a string.", param=f"{where}.{kind}")
    if source is None:
        raise BadRequestError(f"{where} of type {kind!r} has no {kind!r} field.", param=f"{where}.{kind}")
    media.setdefault(MEDIA_PARTS[kind], []).append(source)
    return {"type": MEDIA_PARTS[kind]}


def _input_audio(value: Any, where: str) -> bytes:
    """OpenAI's {"data": base64, "format": "wav" | "mp3" | ...} -> the encoded audio bytes."""
    from vllm_neuron.multimodal.audio import AUDIO_FORMATS

    if not isinstance(value, dict) or not isinstance(value.get("data"), str):
        raise BadRequestError(f"{where}.input_audio must be an object with base64 `data` and a `format`.",
                              param=f"{where}.input_audio")
    fmt = value.get("format")
    if fmt not in AUDIO_FORMATS:
        raise BadRequestError(f"{where}.input_audio.format {fmt!r} is not supported; supported: {list(AUDIO_FORMATS)}.",
                              param=f"{where}.input_audio.format")
    try:
        return base64.b64decode(value["data"], validate=True)
    except (binascii.Error, ValueError):
        raise BadRequestError(f"{where}.input_audio.data is not valid base64.",
                              param=f"{where}.input_audio.data") from None


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
                documents: list[dict[str, str]] | None = None, tools: list[dict] | None = None,
                media: dict[str, list] | None = None) -> str:
    """The prompt text of a conversation; any template failure is the request's fault (400). With
    `media` (a multimodal model) media parts reach the template and their sources are collected there."""
    msgs = normalize_messages(messages, media)
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

