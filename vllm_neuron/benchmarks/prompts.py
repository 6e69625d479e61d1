"""One benchmark prompt (`SampleRequest`) and random-token prompts of an exact token length: the
`random` and `prefix_repetition` datasets, and the text of `random-mm`'s prompts.

Synthetic prompts are built from token ids and then checked by decoding and re-encoding them,
because N random ids seldom decode to text that re-encodes to exactly N ids. The benchmark must
send prompts whose server-side length is the one asked for, or results cannot be compared.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

# Retries of the decode / re-encode adjustment per prompt before accepting a small mismatch.
_MAX_FIT_RETRIES = 10


@dataclass
class SampleRequest:
    """One benchmark prompt: its text, its token count as the server sees it, its output length."""

    prompt: str
    prompt_len: int
    expected_output_len: int
    request_id: str = ""
    # Chat content parts sent before the prompt text (random-mm: image_url / video_url data: URLs).
    multi_modal_content: list[dict] | None = None
    audio: bytes | None = None  # random-audio: the clip uploaded to /v1/audio/transcriptions
    audio_seconds: float = 0.0


def _allowed_token_ids(tokenizer: Any) -> np.ndarray:
    # Special tokens decode to markup (<|im_start|>) that would change the chat structure and
    # re-encode unpredictably; leave them out of random text.
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return np.array([i for i in range(tokenizer.vocab_size) if i not in special], dtype=np.int64)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def num_special_tokens(tokenizer: Any) -> int:
    """Tokens the server's tokenizer adds to a plain prompt (BOS for Llama 3, none for SmolLM2)."""
    fn = getattr(tokenizer, "num_special_tokens_to_add", None)
    return int(fn()) if fn is not None else 0


class _PromptBuilder:
    """Builds text of an exact token length, optionally after a fixed prefix text."""

    def __init__(self, tokenizer: Any, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        self.allowed = _allowed_token_ids(tokenizer)
        self.mismatch = 0

    def random_ids(self, n: int) -> list[int]:
        return self.allowed[self.rng.integers(0, len(self.allowed), size=n)].tolist()

    def fit(self, body: list[int], target: int, prefix_text: str = "",
            prefix_ids: list[int] | None = None) -> tuple[str, list[int]]:
        """Return (text, ids): prefix_text + decoded body, re-encoding to prefix_ids + target ids.

        Random bytes can merge with the prefix's last token when re-encoded; the first body
        token is then redrawn so every prompt keeps the prefix tokens intact (that is what a
        prefix cache can reuse).
        """
        prefix_ids = prefix_ids or []
        n_prefix = len(prefix_ids)
        body = list(body)
        text, ids = prefix_text, list(prefix_ids)
        for attempt in range(_MAX_FIT_RETRIES + 1):
            text = prefix_text + self.tokenizer.decode(body)
            ids = encode_text(self.tokenizer, text)
            if ids[:n_prefix] != prefix_ids:
                if attempt == _MAX_FIT_RETRIES or not body:
                    break
                body[0] = self.random_ids(1)[0]
                continue
            tail = ids[n_prefix:]
            if len(tail) == target:
                return text, ids
            if attempt == _MAX_FIT_RETRIES:
                break
            body = tail[:target] + self.random_ids(max(0, target - len(tail)))
        self.mismatch += len(ids) - (n_prefix + target)
        return text, ids

    def warn_mismatch(self) -> None:
        if self.mismatch:
            logger.warning("Random prompts have %d %s tokens in total than asked for after "
                           "decoding and re-encoding.", abs(self.mismatch),
                           "more" if self.mismatch > 0 else "fewer")


def _length_range(length: int, ratio: float, minimum: int) -> tuple[int, int]:
    low = max(math.floor(length * (1 - ratio)), minimum)
    high = max(math.ceil(length * (1 + ratio)), minimum)
    return low, high


def sample_random_requests(tokenizer: Any, num_requests: int, input_len: int = 1024,
                           output_len: int = 128, range_ratio: float = 0.0,
                           prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """Random-token prompts of input_len tokens (after a shared prefix of prefix_len tokens).

    input_len counts the tokens the server sees, so tokens the tokenizer adds (BOS) are taken
    off the random part. Same seed, same prompts; another seed, other prompts.
    """
    if num_requests < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_requests}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if prefix_len < 0:
        raise ValueError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    if output_len < 1:
        raise ValueError(f"--random-output-len must be >= 1, got {output_len}")
    n_special = num_special_tokens(tokenizer)
    real_input_len = max(0, input_len - n_special)
    in_low, in_high = _length_range(real_input_len, range_ratio, 0)
    if prefix_len + in_low < 1:
        raise ValueError(f"--random-input-len {input_len} with --random-prefix-len {prefix_len} "
                         "leaves no prompt tokens; ask for at least one token")
    out_low, out_high = _length_range(output_len, range_ratio, 1)
    rng = np.random.default_rng(seed)
    builder = _PromptBuilder(tokenizer, rng)
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    offsets = rng.integers(0, len(builder.allowed), size=num_requests)

    prefix_text, prefix_ids = "", []
    if prefix_len > 0:
        prefix_text, prefix_ids = builder.fit(builder.random_ids(prefix_len), prefix_len)

    requests = []
    n_allowed = len(builder.allowed)
    for i in range(num_requests):
        n = int(input_lens[i])
        # A walk through the vocabulary from a random start: cheap, and distinct per request.
        body = builder.allowed[(int(offsets[i]) + i + np.arange(n)) % n_allowed].tolist()
        text, ids = builder.fit(body, n, prefix_text, prefix_ids)
        requests.append(SampleRequest(prompt=text, prompt_len=len(ids) + n_special,
                                      expected_output_len=int(output_lens[i]),
                                      request_id=str(i)))
    builder.warn_mismatch()
    return requests


def sample_prefix_repetition_requests(tokenizer: Any, num_requests: int, prefix_len: int = 256,
                                      suffix_len: int = 256, num_prefixes: int = 10,
                                      output_len: int = 128,
                                      seed: int = 0) -> list[SampleRequest]:
    """num_prefixes random prefixes, each shared by num_requests / num_prefixes prompts.

    Each prompt is its prefix plus suffix_len random tokens of its own; the order is shuffled
    so requests sharing a prefix are not sent back to back.
    """
    if num_requests < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num_requests}")
    if num_prefixes < 1 or num_prefixes > num_requests:
        raise ValueError(f"--prefix-repetition-num-prefixes must be in [1, --num-prompts="
                         f"{num_requests}], got {num_prefixes}")
    if prefix_len < 0 or suffix_len < 0 or prefix_len + suffix_len < 1:
        raise ValueError("--prefix-repetition-prefix-len and --prefix-repetition-suffix-len "
                         f"must be >= 0 with a positive sum, got {prefix_len} and {suffix_len}")
    if output_len < 1:
        raise ValueError(f"--prefix-repetition-output-len must be >= 1, got {output_len}")
    rng = np.random.default_rng(seed)
    builder = _PromptBuilder(tokenizer, rng)
    n_special = num_special_tokens(tokenizer)
    requests = []
    for p in range(num_prefixes):
        prefix_text, prefix_ids = builder.fit(builder.random_ids(prefix_len), prefix_len)
        # The first prefixes take the remainder so that exactly num_requests prompts exist.
        count = num_requests // num_prefixes + (1 if p < num_requests % num_prefixes else 0)
        for _ in range(count):
            text, ids = builder.fit(builder.random_ids(suffix_len), suffix_len,
                                    prefix_text, prefix_ids)
            requests.append(SampleRequest(prompt=text, prompt_len=len(ids) + n_special,
                                          expected_output_len=output_len))
    order = rng.permutation(len(requests))
    requests = [requests[i] for i in order]
    for i, req in enumerate(requests):
        req.request_id = str(i)
    builder.warn_mismatch()
    return requests
