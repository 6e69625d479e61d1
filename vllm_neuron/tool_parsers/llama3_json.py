"""Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` (or "arguments"),
optionally after `<|python_tag|>`, several calls separated by `;`. Any other answer is content."""
from __future__ import annotations

import json
from typing import Any

from vllm_neuron.tool_parsers.base import (
    ExtractedToolCalls,
    JsonCallScanner,
    StreamDelta,
    ToolParser,
    ToolParserManager,
    call_from_object,
)

BOT = "<|python_tag|>"


def _strip_bot(text: str) -> str:
    text = text.lstrip()
    return text[len(BOT):].lstrip() if text.startswith(BOT) else text


@ToolParserManager.register
class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._head = ""  # text seen while undecided between content and calls
        self._mode = "undecided"  # -> "content" | "calls"
        self._scanner = JsonCallScanner(call_depth=0)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = _strip_bot(text)
        if not body.startswith("{"):
            return ExtractedToolCalls(False, [], text)
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return ExtractedToolCalls(False, [], text)
            call = call_from_object(obj)
            if call is None:
                return ExtractedToolCalls(False, [], text)
            calls.append(call)
            pos = end
            while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
                pos += 1
        return ExtractedToolCalls(True, calls, None)

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        if self._mode == "content":
            return StreamDelta(content=delta_text)
        if self._mode == "calls":
            return StreamDelta(tool_calls=self._scanner.feed(delta_text))
        self._head += delta_text
        head = self._head.lstrip()
        if not head or BOT.startswith(head):
            return StreamDelta()  # only spaces, or a partial <|python_tag|>: wait for more
        body = _strip_bot(head) if head.startswith(BOT) else head
        if head.startswith(BOT) and not body:
            return StreamDelta()
        if body.startswith("{"):
            self._mode = "calls"
            return StreamDelta(tool_calls=self._scanner.feed(body))
        self._mode = "content"
        text, self._head = self._head, ""
        return StreamDelta(content=text)

    def finish_streaming(self) -> StreamDelta:
        if self._mode == "undecided" and self._head:
            text, self._head = self._head, ""
            return StreamDelta(content=text)
        return StreamDelta(tool_calls=self._scanner.finish())

    @property
    def tools_called(self) -> bool:
        return any(c.header_sent for c in self._scanner.calls)
