"""`SamplingParams`: vLLM's per-request sampling fields, defaults and validation.

This module is imported by the scheduler, the engine and the API server, and instances cross the
process boundary (pickled, inside EngineCoreRequest). Keep it free of torch.
"""
from __future__ import annotations

import copy
import enum
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# Below this temperature a request is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# Temperatures in (0, MIN_RANDOM_TEMPERATURE) overflow the softmax; vLLM raises them to this value.
MIN_RANDOM_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # vLLM's range: torch's int64


class RequestOutputKind(enum.Enum):
    # Every RequestOutput carries the whole output so far.
    CUMULATIVE = 0
    # Every RequestOutput carries only what is new since the previous one.
    DELTA = 1
    # Only the final RequestOutput is produced.
    FINAL_ONLY = 2


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Sampling parameters for one request, with vLLM's names, defaults and meaning."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    logprobs: int | None = None  # -1: the whole vocabulary
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # A StructuredOutputsParams (a dict with its fields is converted); applied as a token mask inside
    # the graph, so it needs no host sampling.
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: dict[str, Any] | None = None
    # Set by the engine's input processor from the tokenizer, not by users.
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # stop_token_ids and the model's EOS, set by the worker (vLLM's all_stop_token_ids): what min_tokens holds back.
    _all_stop_token_ids: list[int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = RequestOutputKind(self.output_kind)
        if _is_int(self.temperature):
            self.temperature = float(self.temperature)
        if isinstance(self.temperature, float) and 0.0 < self.temperature < MIN_RANDOM_TEMPERATURE:
            logger.warning(
                "temperature %s is less than %s, which may cause numerical errors (nan or inf); "
                "raised to %s.", self.temperature, MIN_RANDOM_TEMPERATURE, MIN_RANDOM_TEMPERATURE)
            self.temperature = MIN_RANDOM_TEMPERATURE
        if self.seed == -1:
            self.seed = None

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        # Duplicates would only cost time in every check; order is kept for reproducible errors.
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        self.bad_words = [] if self.bad_words is None else list(dict.fromkeys(self.bad_words))
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.logit_bias is not None:
            self.logit_bias = self._normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)

        self._verify_args()

        if self.temperature < SAMPLING_EPS:
            # Zero temperature means greedy: the truncation knobs cannot change an argmax.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when using greedy sampling, got {self.n}.")

    @staticmethod
    def _normalize_logit_bias(logit_bias: dict[Any, float]) -> dict[int, float]:
        # JSON object keys arrive as strings ("50256": -100); the sampler indexes by int.
        converted: dict[int, float] = {}
        invalid = []
        for token, bias in logit_bias.items():
            try:
                converted[int(token)] = float(bias)
            except (TypeError, ValueError):
                invalid.append(token)
        if invalid:
            raise ValueError(
                f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid!r}")
        # A NaN bias compares with nothing: the server would clamp it to an arbitrary end of [-100, 100].
        not_finite = [t for t, b in converted.items() if not math.isfinite(b)]
        if not_finite:
            raise ValueError(f"logit_bias values must be finite numbers; token(s) {not_finite[:10]} have "
                             f"{[converted[t] for t in not_finite[:10]]}")
        return converted

    def _verify_args(self) -> None:
        if not _is_int(self.n):
            raise ValueError(f"n must be an int, but is of type {type(self.n)}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number, got {self.repetition_penalty}.")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if self.temperature > MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__}")
        # -1 is accepted quietly as "off", like vLLM; 0 is preferred.
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}.")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            # A larger seed would overflow torch.Generator.manual_seed inside the engine.
            raise ValueError(f"seed must be a 64-bit signed integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.")
        if self.logprobs is not None and self.logprobs != -1 and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs != -1 and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative or -1, got {self.prompt_logprobs}.")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must contain only integers, got {self.stop_token_ids}.")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop.")
        if any(not w for w in self.bad_words):
            raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}")
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise ValueError("allowed_token_ids is not None and empty!")
            if not all(_is_int(t) for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must contain only integers, got {self.allowed_token_ids}.")

    def verify(self, vocab_size: int, max_logprobs: int | None = None) -> None:
        """Checks what needs the model: token ids inside the vocabulary, logprobs under the cap.

        `max_logprobs` None means the whole vocabulary (the offline default); the server passes 20.
        """
        cap = vocab_size if max_logprobs is None or max_logprobs == -1 else max_logprobs
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if value:
                wanted = vocab_size if value == -1 else value
                if wanted > cap:
                    raise ValueError(f"Requested {name.replace('_', ' ')} of {wanted}, "
                                     f"which is greater than max allowed: {cap}")
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", list(self.logit_bias or ())),
                          ("allowed_token_ids", self.allowed_token_ids or [])):
            invalid = [t for t in ids if t < 0 or t >= vocab_size]
            if invalid:
                raise ValueError(f"token_id(s) {invalid} in {name} contain out-of-vocab token ids. "
                                 f"Vocabulary size: {vocab_size}")

    @property
    def all_stop_token_ids(self) -> list[int]:
        """The stop token ids and the model's EOS (once the engine has the request), as vLLM's."""
        return self._all_stop_token_ids if self._all_stop_token_ids is not None else list(self.stop_token_ids)

    @property
    def needs_host_sampling(self) -> bool:
        """True when the request uses something the in-graph sampler (greedy/temperature/top-k/top-p)
        does not do; such rows are sampled on the host from the logits."""
        return (self.min_p > 0.0
                or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0
                or bool(self.logit_bias)
                or self.allowed_token_ids is not None
                or bool(self.bad_words)
                or self.min_tokens > 0
                or self.logprobs is not None)

    def clone(self) -> SamplingParams:
        # Deep: the engine mutates per-request state (EOS ids, tokenized bad words) on its copy.
        return copy.deepcopy(self)


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (`LLM.beam_search`; vllm_neuron/beam_search.py runs the search)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}")

    def step_params(self) -> SamplingParams:
        """One token per beam with its 2 x beam_width best candidates (vLLM's expansion)."""
        return SamplingParams(temperature=self.temperature, max_tokens=1, logprobs=2 * self.beam_width,
                              ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
