"""Tool-call parsing shared by every model family: the call types, the parser interface, the registry,
and an incremental scanner that turns streamed JSON call objects into OpenAI `tool_calls` deltas.

Parsers are stateful per completion (one instance per choice): `extract_tool_calls_streaming` is fed the
text deltas in order, `finish_streaming` once at the end.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

ARGUMENT_KEYS = ("arguments", "parameters")


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class FunctionCall:
    name: str
    arguments: str  # JSON text


@dataclass
class ToolCall:
    function: FunctionCall
    id: str = field(default_factory=make_tool_call_id)
    type: str = "function"


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass
class DeltaFunctionCall:
    name: str | None = None
    arguments: str | None = None


@dataclass
class DeltaToolCall:
    """One streamed piece of call `index`: the first carries id, type and name (arguments ""), later
    ones argument fragments whose concatenation is the arguments' JSON text."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"], out["type"] = self.id, self.type or "function"
        if self.function is not None:
            out["function"] = {k: v for k, v in (("name", self.function.name),
                                                 ("arguments", self.function.arguments)) if v is not None}
        return out


@dataclass
class StreamDelta:
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content) or bool(self.tool_calls)


def call_from_object(obj: Any) -> ToolCall | None:
    """{"name": str, "arguments"|"parameters": object} -> ToolCall; None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in ARGUMENT_KEYS if k in obj), {})
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(FunctionCall(obj["name"], text))


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `token` (to hold back)."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


@dataclass
class _Call:
    index: int
    id: str = field(default_factory=make_tool_call_id)
    name: str | None = None
    header_sent: bool = False
    args_text: str | None = None  # the complete arguments JSON, once its value has ended
    args_sent: int = 0  # characters of the arguments text already streamed


class JsonCallScanner:
    """Incremental scanner of JSON text holding call objects {"name": ..., "arguments": ...} at nesting
    depth `call_depth` (0: a sequence of objects with anything between them; 1: the elements of one
    top-level array). `feed` returns the new `tool_calls` deltas. An object or array of arguments is
    streamed as the raw JSON text of its value while it is written, so the fragments of one call
    concatenate to its arguments' JSON text."""

    def __init__(self, call_depth: int = 0, args_keys: tuple[str, ...] = ARGUMENT_KEYS) -> None:
        self.call_depth = call_depth
        self.args_keys = args_keys
        self.text = ""
        self.calls: list[_Call] = []
        self._pos = 0
        self._stack: list[str] = []
        self._in_call = False
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._expect_key = False  # inside a call object, the next string is a key
        self._key: str | None = None
        self._value_key: str | None = None  # key whose value starts at the next non-space character
        self._value_start: int | None = None
        self._value_kind = ""  # "container", "string" or "scalar"

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def feed(self, delta: str) -> list[DeltaToolCall]:
        self.text += delta
        text, level = self.text, self.call_depth + 1
        while self._pos < len(text):
            i, ch = self._pos, text[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    self._string_closed(i)
                continue
            at_level = self._in_call and len(self._stack) == level
            if at_level and self._value_key is not None and self._value_start is None and not ch.isspace():
                self._value_start = i
                self._value_kind = "container" if ch in "{[" else "string" if ch == '"' else "scalar"
            if ch == '"':
                self._in_string, self._string_start = True, i
            elif ch in "{[":
                self._stack.append(ch)
                if not self._in_call and ch == "{" and len(self._stack) == level \
                        and (level == 1 or self._stack[0] == "["):
                    self.calls.append(_Call(len(self.calls)))
                    self._in_call, self._expect_key = True, True
            elif ch in "}]":
                if not self._stack:
                    continue  # stray closer outside any JSON value
                if at_level and self._value_kind == "scalar":
                    self._end_value(i)
                self._stack.pop()
                if self._in_call and len(self._stack) == level and self._value_kind == "container":
                    self._end_value(i + 1)
                elif self._in_call and len(self._stack) == level - 1:
                    self._in_call = False
                    self._value_key, self._value_start, self._value_kind, self._key = None, None, "", None
            elif at_level:
                if ch == ",":
                    if self._value_kind == "scalar":
                        self._end_value(i)
                    self._expect_key = True
                elif ch == ":" and self._key is not None:
                    self._value_key, self._value_start, self._key = self._key, None, None
        return self._emit()

    def _string_closed(self, end: int) -> None:
        if not self._in_call or len(self._stack) != self.call_depth + 1:
            return
        raw = self.text[self._string_start:end + 1]
        if self._expect_key and self._value_key is None:
            self._key, self._expect_key = _loads(raw), False
        elif self._value_kind == "string":
            value = _loads(raw)
            if self._value_key == "name" and self.calls[-1].name is None and isinstance(value, str):
                self.calls[-1].name = value
            if self._value_key in self.args_keys and self.calls[-1].args_text is None:
                # Arguments given as a JSON string: the string's content is the arguments text.
                self.calls[-1].args_text = value if isinstance(value, str) else raw
            self._value_key, self._value_start, self._value_kind = None, None, ""

    def _end_value(self, end: int) -> None:
        call = self.calls[-1]
        if self._value_key in self.args_keys and call.args_text is None and self._value_start is not None:
            # A scalar ends at its delimiter: the spaces before it are not part of the value.
            call.args_text = self.text[self._value_start:end].rstrip()
        self._value_key, self._value_start, self._value_kind = None, None, ""

    def _arguments_so_far(self, call: _Call) -> str:
        if call.args_text is not None:
            return call.args_text
        if call is self.calls[-1] and self._in_call and self._value_key in self.args_keys \
                and self._value_kind == "container":
            return self.text[self._value_start:]
        return ""

    def _emit(self) -> list[DeltaToolCall]:
        out = []
        for call in self.calls:
            if call.name is None:
                continue
            delta = None
            if not call.header_sent:
                call.header_sent = True
                delta = DeltaToolCall(call.index, call.id, "function", DeltaFunctionCall(call.name, ""))
            text = self._arguments_so_far(call)
            if len(text) > call.args_sent:
                delta = delta or DeltaToolCall(call.index, function=DeltaFunctionCall(arguments=""))
                delta.function.arguments += text[call.args_sent:]
                call.args_sent = len(text)
            if delta is not None:
                out.append(delta)
        return out

    def finish(self) -> list[DeltaToolCall]:
        """At the end of the text: calls that never had arguments get "{}"."""
        out = self._emit()
        for call in self.calls:
            if call.name is not None and call.args_sent == 0 and call.args_text is None \
                    and not (call is self.calls[-1] and self._in_call and self._value_key in self.args_keys):
                call.args_sent = 2
                out.append(DeltaToolCall(call.index, function=DeltaFunctionCall(arguments="{}")))
        return out


def _loads(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return None


class ToolParser:
    """One model family's tool-call format. Subclasses set `name` and implement the two extractors."""

    name: ClassVar[str] = ""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def adjust_request(self, sampling_params: Any) -> None:
        """Changes the request so that the markers the parser needs survive detokenization."""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, delta_text: str) -> StreamDelta:
        raise NotImplementedError

    def finish_streaming(self) -> StreamDelta:
        """Whatever was held back (a partial marker that never completed), at the end of the stream."""
        return StreamDelta()

    @property
    def tools_called(self) -> bool:
        raise NotImplementedError


class ToolParserManager:
    """Registry of tool parsers by the name given to --tool-call-parser."""

    _parsers: ClassVar[dict[str, type[ToolParser]]] = {}

    @classmethod
    def register(cls, parser: type[ToolParser]) -> type[ToolParser]:
        cls._parsers[parser.name] = parser
        return parser

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._parsers)

    @classmethod
    def get(cls, name: str) -> type[ToolParser]:
        try:
            return cls._parsers[name]
        except KeyError:
            raise ValueError(f"--tool-call-parser {name!r} is not available; valid parsers: "
                             f"{', '.join(cls.names())}") from None
