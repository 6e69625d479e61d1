"""One chat choice's output -> reasoning, content and tool calls, streamed or whole.

`ChoiceParser` is what serving_chat asks of every kind of output: the text path (a `<think>` reasoning
parser, then the tool-call stream on the answer) here, harmony's channels for gpt-oss in
harmony/chat_parser.py. `feed` takes each delta (text and token ids) in order, `finish` once at the end;
`final` parses a whole answer the way the stream would (streamed deltas add up to it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.entrypoints.openai.tool_calls import ToolCallStream, ToolChoice, extract_final
from vllm_neuron.reasoning import ReasoningDelta, ReasoningParser
from vllm_neuron.tool_parsers import DeltaToolCall, ToolCall, ToolParser


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __add__(self, other: ChoiceDelta) -> ChoiceDelta:
        return ChoiceDelta(self.reasoning + other.reasoning, self.content + other.content,
                           self.tool_calls + other.tool_calls)


@dataclass
class ChoiceResult:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class ChoiceParser:
    def feed(self, text: str, token_ids: list[int]) -> ChoiceDelta:
        raise NotImplementedError

    def finish(self) -> ChoiceDelta:
        raise NotImplementedError

    def final(self, text: str, token_ids: list[int]) -> ChoiceResult:
        raise NotImplementedError

    @property
    def tools_called(self) -> bool:
        raise NotImplementedError


class TextChoiceParser(ChoiceParser):
    """Text models: the reasoning parser (if any) splits off the thinking; the answer goes through the
    tool-call stream of the request's tool_choice."""

    def __init__(self, prompt_text: str, reasoning: ReasoningParser | None, tool: ToolChoice,
                 tool_parser: ToolParser | None) -> None:
        self.prompt_text = prompt_text
        self.reasoning = reasoning
        self.tool = tool
        self.tool_parser = tool_parser
        self.tools = ToolCallStream(tool, tool_parser) if tool.mode != "none" else None
        if reasoning is not None:
            reasoning.start(prompt_text)

    def _answer(self, split: ReasoningDelta, end: bool) -> ChoiceDelta:
        out = ChoiceDelta(reasoning=split.reasoning)
        if self.tools is None:
            out.content = split.content
            return out
        parts = self.tools.feed(split.content) if split.content else None
        if parts is not None:
            out.content, out.tool_calls = parts.content or "", list(parts.tool_calls)
        if end:
            rest = self.tools.finish()
            out.content += rest.content or ""
            out.tool_calls += rest.tool_calls
        return out

    def feed(self, text: str, token_ids: list[int]) -> ChoiceDelta:
        split = self.reasoning.feed(text) if self.reasoning is not None else ReasoningDelta(content=text)
        return self._answer(split, end=False)

    def finish(self) -> ChoiceDelta:
        split = self.reasoning.finish() if self.reasoning is not None else ReasoningDelta()
        return self._answer(split, end=True)

    def final(self, text: str, token_ids: list[int]) -> ChoiceResult:
        if self.reasoning is not None:
            split = self.reasoning.feed(text) + self.reasoning.finish()
        else:
            split = ReasoningDelta(content=text)
        reasoning = split.reasoning if self.reasoning is not None and split.reasoning else None
        content = split.content if split.content or self.reasoning is None else None  # all thinking: None
        if self.tool.mode == "none":
            return ChoiceResult(reasoning, content, [])
        found = extract_final(self.tool, split.content, self.tool_parser)
        self._called = found.tools_called
        if not found.tools_called:
            return ChoiceResult(reasoning, content, [])
        return ChoiceResult(reasoning, found.content, list(found.tool_calls))

    @property
    def tools_called(self) -> bool:
        if hasattr(self, "_called"):
            return self._called
        return self.tools is not None and self.tools.tools_called


def reasoning_fields(text: str | None) -> dict[str, Any]:
    """vLLM's two names of the reasoning field (`reasoning_content`, and the newer `reasoning`)."""
    return {"reasoning_content": text, "reasoning": text}
