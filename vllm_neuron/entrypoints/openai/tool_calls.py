"""Tool calling on /v1/chat/completions: `tools` and `tool_choice` checked and resolved, the JSON
grammar that enforces `required` and a named function, and the per-choice extraction of OpenAI
`tool_calls` from the finished text or from streamed deltas.

Modes: "none" (plain answer), "auto" (the model decides; the server's --tool-call-parser extracts the
calls), "required" (a JSON array of {"name", "parameters"} objects, one or more, enforced), "named"
(the answer is the named function's arguments, enforced).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.structured_output.params import StructuredOutputsParams
from vllm_neuron.tool_parsers.base import (
    DeltaFunctionCall,
    DeltaToolCall,
    ExtractedToolCalls,
    FunctionCall,
    JsonCallScanner,
    StreamDelta,
    ToolCall,
    ToolParser,
    call_from_object,
    make_tool_call_id,
)

AUTO_NEEDS_FLAGS = ('"auto" tool choice (the default when `tools` are given) requires --enable-auto-tool-choice '
                    "and --tool-call-parser to be set")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None
    structured_outputs: StructuredOutputsParams | None = None  # the grammar of required / named


def _tool_functions(tools: list[Any]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                                  "\"parameters\": {...}}}}.", param=f"tools[{i}]")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise BadRequestError(f"tools[{i}].function.parameters must be a JSON schema object.",
                                  param=f"tools[{i}].function.parameters")
        out[fn["name"]] = params or _EMPTY_PARAMETERS
    return out


def resolve_tool_choice(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
                        auto_parser: type[ToolParser] | None, auto_served: bool = False) -> ToolChoice:
    """400 for what cannot be honoured; `auto_parser` is the server's --tool-call-parser (None when
    --enable-auto-tool-choice is off); `auto_served`: the output format carries its calls itself (harmony)."""
    param = "tool_choice"
    if tool_choice is None:
        tool_choice, param = ("auto", "tools") if tools else ("none", "tool_choice")
    if not tools:
        if tool_choice != "none":
            raise BadRequestError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        return ToolChoice("none")
    functions = _tool_functions(tools)
    if tool_choice == "none":
        return ToolChoice("none")
    if tool_choice == "auto":
        if auto_parser is None and not auto_served:
            raise BadRequestError(AUTO_NEEDS_FLAGS, param=param)
        return ToolChoice("auto")
    if tool_choice == "required":
        variants = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                      "parameters": params},
                     "required": ["name", "parameters"]} for name, params in functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": variants[0] if len(variants) == 1 else {"anyOf": variants}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        # Compact JSON: tool calls are parsed, not read, and free whitespace lets small models loop on
        # blank lines until max_tokens.
        return ToolChoice("required", structured_outputs=StructuredOutputsParams(json=schema,
                                                                                 disable_any_whitespace=True))
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise BadRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}.', param="tool_choice")
        if name not in functions:
            raise BadRequestError(f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")
        return ToolChoice("named", name, StructuredOutputsParams(json=functions[name], disable_any_whitespace=True))
    raise BadRequestError(f'tool_choice {tool_choice!r} is not valid: use "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}.', param="tool_choice")


def extract_final(choice: ToolChoice, text: str, parser: ToolParser | None) -> ExtractedToolCalls:
    """The calls in a finished answer; an answer cut short (max_tokens) that does not parse stays content."""
    if choice.mode == "auto" and parser is not None:
        return parser.extract_tool_calls(text)
    if choice.mode == "named":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, [ToolCall(FunctionCall(choice.name, text))], None)
    if choice.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return ExtractedToolCalls(False, [], text)
        calls = [call_from_object(item) for item in items] if isinstance(items, list) else [None]
        if not calls or any(c is None for c in calls):
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, None)
    return ExtractedToolCalls(False, [], text)


class ToolCallStream:
    """One choice's streamed text -> content and `tool_calls` deltas, for every mode."""

    def __init__(self, choice: ToolChoice, parser: ToolParser | None) -> None:
        self.choice = choice
        self.parser = parser if choice.mode == "auto" else None
        self._scanner = JsonCallScanner(call_depth=1, args_keys=("parameters",)) \
            if choice.mode == "required" else None
        self._named_id: str | None = None

    def feed(self, delta_text: str) -> StreamDelta:
        mode = self.choice.mode
        if mode == "auto" and self.parser is not None:
            return self.parser.extract_tool_calls_streaming(delta_text)
        if mode == "required":
            return StreamDelta(tool_calls=self._scanner.feed(delta_text))
        if mode == "named":
            if not delta_text:
                return StreamDelta()
            if self._named_id is None:
                self._named_id = make_tool_call_id()
                return StreamDelta(tool_calls=[DeltaToolCall(0, self._named_id, "function",
                                                             DeltaFunctionCall(self.choice.name, delta_text))])
            return StreamDelta(tool_calls=[DeltaToolCall(0, function=DeltaFunctionCall(arguments=delta_text))])
        return StreamDelta(content=delta_text)

    def finish(self) -> StreamDelta:
        if self.parser is not None:
            return self.parser.finish_streaming()
        if self._scanner is not None:
            return StreamDelta(tool_calls=self._scanner.finish())
        return StreamDelta()

    @property
    def tools_called(self) -> bool:
        if self.parser is not None:
            return self.parser.tools_called
        if self._scanner is not None:
            return any(c.header_sent for c in self._scanner.calls)
        return self._named_id is not None
