"""`<think> ... </think>` reasoning: Qwen3 (`qwen3`) and DeepSeek-R1 (`deepseek_r1`).

Where the reasoning starts: inside the block when the output opens it with `<think>`, or when the
prompt already opened it (a template that ends the generation prompt with `<think>`, as DeepSeek-R1's
and Qwen3's thinking-only models do). A Qwen3 prompt with thinking off ends with an empty, closed block,
so the answer is content. DeepSeek-R1 always answers inside an open block unless the prompt closed it:
its output without `</think>` is all reasoning (cut short), as in vLLM.
"""
from __future__ import annotations

from typing import Any

from vllm_neuron.reasoning.base import ReasoningDelta, ReasoningParser, ReasoningParserManager

START, END = "<think>", "</think>"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (may complete later)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkReasoningParser(ReasoningParser):
    opens_by_default = False  # the answer starts inside the block even when the prompt did not open it

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self._state = "start"  # "start" (may still see <think>), "reasoning", "content"
        self._buf = ""

    def start(self, prompt_text: str) -> None:
        tail = prompt_text.rstrip()
        if tail.endswith(START):
            self._state = "reasoning"
        elif tail.endswith(END):
            self._state = "content"
        else:
            self._state = "start"

    @property
    def reasoning_done(self) -> bool:
        return self._state == "content"

    def reasoning_end_token_id(self) -> int | None:
        ids = self.tokenizer.encode(END, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def feed(self, delta_text: str) -> ReasoningDelta:
        self._buf += delta_text
        out = ReasoningDelta()
        while self._buf:
            if self._state == "start":
                stripped = self._buf.lstrip()
                if stripped.startswith(START):
                    self._buf, self._state = stripped[len(START):], "reasoning"
                elif START.startswith(stripped):
                    return out  # "<thi" so far: wait for the rest
                else:
                    self._state = "reasoning" if self.opens_by_default else "content"
            elif self._state == "reasoning":
                at = self._buf.find(END)
                if at >= 0:
                    out.reasoning += self._buf[:at]
                    self._buf, self._state = self._buf[at + len(END):], "content"
                    continue
                keep = _held_prefix(self._buf, END)
                out.reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            else:
                out.content += self._buf
                self._buf = ""
        return out

    def finish(self) -> ReasoningDelta:
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=rest)
        return ReasoningDelta(content=rest)


@ReasoningParserManager.register
class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"


@ReasoningParserManager.register
class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    opens_by_default = True
