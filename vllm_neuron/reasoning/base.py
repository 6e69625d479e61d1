"""The reasoning parser interface and its registry.

A parser is stateful per completion (one instance per choice): `start(prompt_text)` once, then `feed`
with the text deltas in order and `finish` at the end. The non-streamed answer is `split(text)`, the
same machine fed the whole text, so streamed deltas always add up to the non-streamed fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __add__(self, other: ReasoningDelta) -> ReasoningDelta:
        return ReasoningDelta(self.reasoning + other.reasoning, self.content + other.content)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


class ReasoningParser:
    name: ClassVar[str] = ""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def start(self, prompt_text: str) -> None:
        """The rendered prompt: a template may open (or close) the reasoning block itself."""

    def feed(self, delta_text: str) -> ReasoningDelta:
        raise NotImplementedError

    def finish(self) -> ReasoningDelta:
        """Whatever was held back (a partial tag that never completed)."""
        return ReasoningDelta()

    @property
    def reasoning_done(self) -> bool:
        """True once the text fed so far (or the prompt) has closed the reasoning block."""
        raise NotImplementedError

    def reasoning_end_token_id(self) -> int | None:
        """The token that ends the reasoning (a structured output starts after it), when it is one token."""
        return None

    def split(self, prompt_text: str, text: str) -> ReasoningDelta:
        self.start(prompt_text)
        return self.feed(text) + self.finish()


class ReasoningParserManager:
    """Registry of reasoning parsers by the name given to --reasoning-parser (vLLM's names)."""

    _parsers: ClassVar[dict[str, type[ReasoningParser] | None]] = {}

    @classmethod
    def register(cls, parser: type[ReasoningParser]) -> type[ReasoningParser]:
        cls._parsers[parser.name] = parser
        return parser

    @classmethod
    def names(cls) -> list[str]:
        # openai_gptoss is served by the harmony path (vllm_neuron/harmony), not by a text parser.
        return sorted([*cls._parsers, HARMONY_PARSER])

    @classmethod
    def get(cls, name: str) -> type[ReasoningParser]:
        if name not in cls._parsers:
            raise ValueError(f"--reasoning-parser {name!r} is not available; valid parsers: "
                             f"{', '.join(cls.names())}")
        return cls._parsers[name]


HARMONY_PARSER = "openai_gptoss"
