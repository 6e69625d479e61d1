"""Completion tokens of gpt-oss -> reasoning (analysis channel), content (final channel, preambles) and
function calls (commentary messages to `functions.NAME`), token by token through openai-harmony's
StreamableParser. Output that is not valid harmony (a header the model never finished, a recipient that
is not one of the request's functions) comes back as content, with a warning, never as an error.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.logger import init_logger
from vllm_neuron.tool_parsers.base import DeltaFunctionCall, DeltaToolCall, make_tool_call_id

logger = init_logger(__name__)


@dataclass
class HarmonyDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class HarmonyStream:
    def __init__(self, encoding: Any, functions: set[str], prefill: list[int]) -> None:
        from openai_harmony import Role, StreamableParser

        self.encoding = encoding
        self.functions = functions
        self.parser = StreamableParser(encoding, role=Role.ASSISTANT)
        for t in prefill:
            self.parser.process(t)
        self.calls = 0
        self._call_message: int | None = None  # index of the message the open call is written in
        self._quiet: list[int] = []  # tokens of the current message that gave no text yet (its header)
        self._broken = False
        self._tail: list[int] = []  # after a parse error: tokens whose text is not whole UTF-8 yet
        self._warned: set[str] = set()

    def _warn(self, what: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning("gpt-oss output is not valid harmony (%s): returned as content", what)

    def _raw(self, tokens: list[int]) -> str:
        return self.encoding.decode(tokens) if tokens else ""

    def feed(self, token_ids: list[int]) -> HarmonyDelta:
        from openai_harmony import HarmonyError

        out = HarmonyDelta()
        for t in token_ids:
            if self._broken:
                out.content += self._text_after_break([t])
                continue
            done = len(self.parser.messages)
            try:
                self.parser.process(t)
            except HarmonyError as e:
                self._warn(str(e))
                self._broken = True
                out.content += self._text_after_break(self._quiet + [t])
                self._quiet = []
                continue
            if len(self.parser.messages) > done:
                self._quiet = []  # a message ended (its stop token is no text)
                continue
            delta = self.parser.last_content_delta
            if not delta:
                self._quiet.append(t)
                continue
            self._quiet = []
            self._route(delta, out)
        return out

    def _text_after_break(self, tokens: list[int]) -> str:
        """The text of the tokens so far, once it is whole UTF-8 (a character may span tokens)."""
        self._tail += tokens
        try:
            text = self.encoding.decode_utf8(self._tail)
        except Exception:  # noqa: BLE001 - a character cut between tokens: wait for the rest
            return ""
        self._tail = []
        return text

    def _route(self, delta: str, out: HarmonyDelta) -> None:
        recipient, channel = self.parser.current_recipient, self.parser.current_channel
        if recipient and recipient != "assistant":
            name = recipient[len("functions."):] if recipient.startswith("functions.") else None
            if name in self.functions:
                message = len(self.parser.messages)
                if self._call_message != message:
                    self._call_message = message
                    out.tool_calls.append(DeltaToolCall(self.calls, make_tool_call_id(), "function",
                                                        DeltaFunctionCall(name, "")))
                    self.calls += 1
                out.tool_calls.append(DeltaToolCall(self.calls - 1, function=DeltaFunctionCall(arguments=delta)))
                return
            self._warn(f"unknown recipient {recipient!r}")
            out.content += delta
        elif channel == "analysis":
            out.reasoning += delta
        else:
            out.content += delta

    def finish(self) -> HarmonyDelta:
        """A message the model left in its header (cut short, or never a message) comes back as text."""
        from openai_harmony import StreamState

        out = HarmonyDelta(content=self._raw(self._tail))
        self._tail = []
        if self._quiet and self.parser.state == StreamState.HEADER:
            self._warn("a message header that never completed")
            out.content += self._raw(self._quiet)
        self._quiet = []
        return out
