"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, any number,
after optional content."""
from __future__ import annotations

import json
import re
from typing import Any

from vllm_neuron.tool_parsers.base import (
    ExtractedToolCalls,
    JsonCallScanner,
    StreamDelta,
    ToolParser,
    ToolParserManager,
    call_from_object,
    partial_suffix,
)

START, END = "<tool_call>", "</tool_call>"
# A block may be cut off by max_tokens: the last one may lack its end tag.
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


@ToolParserManager.register
class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._pending = ""
        self._mode = "content"  # content -> call -> between -> call ...
        self._scanner = JsonCallScanner(call_depth=0)

    def adjust_request(self, sampling_params: Any) -> None:
        # Where <tool_call> is a special token, skipping special tokens would erase the markers.
        sampling_params.skip_special_tokens = False

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find(START)
        if start < 0:
            return ExtractedToolCalls(False, [], text)
        calls = []
        for match in _BLOCK.finditer(text):
            body = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
            try:
                call = call_from_object(json.loads(body))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ExtractedToolCalls(False, [], text)
            calls.append(call)
        content = text[:start]
        return ExtractedToolCalls(True, calls, content if content.strip() else None)

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        self._pending += delta_text
        out = StreamDelta()
        while self._pending:
            if self._mode in ("content", "between"):
                idx = self._pending.find(START)
                if idx < 0:
                    keep = partial_suffix(self._pending, START)
                    emit = self._pending[:len(self._pending) - keep]
                    if self._mode == "content" and emit:
                        out.content = (out.content or "") + emit
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                if self._mode == "content" and idx:
                    out.content = (out.content or "") + self._pending[:idx]
                self._pending, self._mode = self._pending[idx + len(START):], "call"
            else:
                idx = self._pending.find(END)
                if idx < 0:
                    keep = partial_suffix(self._pending, END)
                    out.tool_calls += self._scanner.feed(self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                out.tool_calls += self._scanner.feed(self._pending[:idx])
                self._pending, self._mode = self._pending[idx + len(END):], "between"
        return out

    def finish_streaming(self) -> StreamDelta:
        out = StreamDelta()
        if self._mode == "call" and self._pending:
            out.tool_calls += self._scanner.feed(self._pending)
        elif self._mode == "content" and self._pending:
            out.content = self._pending
        self._pending = ""
        out.tool_calls += self._scanner.finish()
        return out

    @property
    def tools_called(self) -> bool:
        return any(c.header_sent for c in self._scanner.calls)
