"""Incremental detokenization and stop strings for one completion (pure Python + a tokenizer).

Text is produced with the offsets algorithm: decode a short window of tokens, and emit only what the
newest tokens added to the window's text. A window whose text ends in U+FFFD is held until more tokens
arrive: a byte-level (or byte-fallback) token can be half of a multi-byte character, and decoding it
alone shows a replacement character that the next token turns into the real one.

The window starts at the first output token, not in the prompt, so the final text equals
`tokenizer.decode(output_ids, skip_special_tokens=...)` exactly (with byte-level BPE, as for SmolLM2
and Llama 3, decoding is context-free and nothing is lost).

`spaces_between_special_tokens` as vLLM's detokenizer for (fast) tokenizers: true writes added tokens as
the tokenizer's decoder does; false (with special tokens kept) writes an added token that follows
another one as its bare content, without the space some decoders (WordPiece, Metaspace) put before it.
Byte-level decoders put none, so for SmolLM2 and Llama 3 both give the same text.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm_neuron.sampling_params import SamplingParams

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one completion token by token and evaluates its stop strings."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.prompt_len = len(prompt_token_ids)
        self.skip_special_tokens = params.skip_special_tokens
        # Added token id -> its content, where a run of added tokens is written without spaces.
        self._bare_added: dict[int, str] = {}
        if not params.spaces_between_special_tokens and not params.skip_special_tokens:
            self._bare_added = {tid: str(tok) for tid, tok in getattr(tokenizer, "added_tokens_decoder", {}).items()}
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.output_token_ids: list[int] = []
        self.output_text = ""
        # Window over output_token_ids: [prefix_offset, read_offset) is already emitted context,
        # [read_offset, end) is pending.
        self._prefix_offset = 0
        self._read_offset = 0
        self._last_delta_offset = 0
        self._stopped = False

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self, flush: bool = False) -> str:
        """Emits the text the pending tokens add, or "" while it still ends mid-character."""
        ids = self.output_token_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(ids[self._prefix_offset:])
        if len(full_text) > len(prefix_text) and (flush or not full_text.endswith(_REPLACEMENT_CHAR)):
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
            return full_text[len(prefix_text):]
        return ""

    def update(self, new_token_ids: Sequence[int], stop_terminated: bool = False) -> str | None:
        """Appends tokens, extends output_text and checks stop strings.

        stop_terminated: the last token ended the request (EOS or a stop token id); its text is left
        out unless include_stop_str_in_output, as in vLLM. Returns the matched stop string or None;
        on a match output_text is cut before it (or after it with include_stop_str_in_output).
        """
        if self._stopped:
            # A token that raced the stop (async scheduling) changes nothing: the text is final.
            return None
        new_token_ids = list(new_token_ids)
        skipped = None
        if stop_terminated and new_token_ids and not self.include_stop_str_in_output:
            skipped = new_token_ids.pop()
        # Stop strings that end inside the first min_tokens tokens' text do not count.
        check_from = len(self.output_text)
        for token_id in new_token_ids:
            self.output_token_ids.append(token_id)
            delta = self._decode_next()
            if delta and token_id in self._bare_added and len(self.output_token_ids) > 1 \
                    and self.output_token_ids[-2] in self._bare_added:
                delta = self._bare_added[token_id]
            self.output_text += delta
            if self.min_tokens and len(self.output_token_ids) <= self.min_tokens:
                check_from = len(self.output_text)
        if skipped is not None:
            # The completion ends here: a held-back partial character will never complete.
            self.finish()
            # The stop token counts as output but is never decoded: move the window past it.
            self.output_token_ids.append(skipped)
            self._prefix_offset = self._read_offset = len(self.output_token_ids)
        if not self.stop or len(self.output_token_ids) <= self.min_tokens:
            return None
        return self._check_stop_strings(check_from)

    def _check_stop_strings(self, check_from: int) -> str | None:
        if check_from >= len(self.output_text):
            return None
        # The earliest match wins; text before check_from was searched already, but a stop string
        # may begin up to len(stop) - 1 characters before it.
        best: tuple[int, int, str] | None = None
        for order, stop in enumerate(self.stop):
            idx = self.output_text.find(stop, max(0, check_from - len(stop) + 1))
            if idx != -1 and (best is None or (idx, order) < best[:2]):
                best = (idx, order, stop)
        if best is None:
            return None
        idx, _, stop = best
        cut = idx + len(stop) if self.include_stop_str_in_output else idx
        self.output_text = self.output_text[:cut]
        self._stopped = True
        return stop

    def finish(self) -> None:
        """Emits text still held back for an unfinished character (a genuinely invalid UTF-8 tail)."""
        if not self._stopped and self._read_offset < len(self.output_token_ids):
            self.output_text += self._decode_next(flush=True)

    def _held_back(self) -> int:
        """Length of the longest tail of output_text that could still begin a stop string."""
        if not self.stop or self.include_stop_str_in_output or self._stopped:
            return 0
        text = self.output_text
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def get_delta_text(self, finished: bool) -> str:
        """New text since the previous call; holds back a tail that may begin a stop string."""
        if finished:
            self.finish()
        end = len(self.output_text) if finished else len(self.output_text) - self._held_back()
        if end <= self._last_delta_offset:
            return ""
        delta = self.output_text[self._last_delta_offset:end]
        self._last_delta_offset = end
        return delta

    def get_cumulative_text(self, finished: bool) -> str:
        """All text so far that is safe to show (without the held-back tail unless finished)."""
        if finished:
            self.finish()
            return self.output_text
        return self.output_text[:len(self.output_text) - self._held_back()]

    def decode_token(self, token_id: int) -> str:
        """Text of one token alone, for logprobs (special tokens shown, as vLLM does)."""
        return self.tokenizer.decode([token_id])

    def convert_ids_to_text(self, token_ids: Sequence[int]) -> list[str]:
        return convert_ids_to_text(self.tokenizer, token_ids)


def convert_ids_to_text(tokenizer: Any, token_ids: Sequence[int]) -> list[str]:
    """Text of each token decoded alone (logprob entries); a partial character shows as U+FFFD."""
    return [tokenizer.decode([t]) or "" for t in token_ids]
