"""Custom logits processors with vLLM V1's batch-level interface (`vllm.v1.sample.logits_processor`).

A processor sees the host sampler's batch: `update_state(BatchUpdate | None)` before every sampling step
(requests added at an index, removed, moved between indices; process them in that order: removed, added,
moved), then `apply(logits)` on the [batch_size, vocab] logits of that batch, row i being the request at
index i. Rows of requests that sample nothing in a step hold zeros and their result is ignored. With
`--logits-processors module:Class` (or `LLM(logits_processors=[Class])`) every request is sampled on the host
and passes through every processor in vLLM's order: those whose `is_argmax_invariant()` is False after
allowed tokens, bad words, min_tokens, logit_bias and the penalties; the argmax-invariant ones after the
temperature and min_p, on the scaled logits, before top-k / top-p. vLLM's built-in min_tokens, logit_bias and
min_p are processors of this interface too (vllm_neuron/worker/builtin_logits_processors.py): subclass them
to take their option from elsewhere (extra_args, say). `__init__(config, device, is_pin_memory)` gets the
engine's resolved config (vllm-neuron's EngineConfig, not vLLM's VllmConfig). An optional classmethod
`validate_params(sampling_params)` raising ValueError refuses a request before it reaches the engine (a
400 over HTTP). A processor that raises during a step fails the request the engine isolates as its cause.
"""
from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_neuron.sampling_params import SamplingParams


class MoveDirectionality(enum.Enum):
    UNIDIRECTIONAL = enum.auto()  # the request at a moves to b (b's state is replaced)
    SWAP = enum.auto()


# (index, sampling params, prompt token ids, output token ids - the live list the engine appends to)
AddedRequest = tuple[int, SamplingParams, list[int], list[int]]
RemovedRequest = int
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    @abstractmethod
    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None: ...

    @abstractmethod
    def apply(self, logits: Any) -> Any:
        """[batch_size, vocab] float32 logits -> the processed logits (in place or a new tensor)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor never changes a greedy row's token."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None: ...

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raises ValueError for a request this processor cannot serve."""


def load_logits_processor(spec: Any) -> type:
    """A `--logits-processors` entry ('package.module:Class', 'package.module.Class' or the class) -> the class,
    or a ValueError naming the entry and what is wrong with it."""
    cls = spec
    if isinstance(spec, str):
        module, sep, name = spec.partition(":")
        if not sep:
            module, _, name = spec.rpartition(".")
        if not module or not name:
            raise ValueError(f"logits_processors: {spec!r} is not 'package.module:Class'")
        try:
            cls = getattr(importlib.import_module(module), name)
        except ImportError as e:
            raise ValueError(f"logits_processors: cannot import module {module!r} of {spec!r}: {e}") from None
        except AttributeError:
            raise ValueError(f"logits_processors: module {module!r} has no {name!r} ({spec!r})") from None
    missing = [m for m in ("apply", "update_state", "is_argmax_invariant") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"logits_processors: {spec!r} is not a logits processor class (vLLM V1's interface: "
                         f"__init__(config, device, is_pin_memory), apply, update_state, is_argmax_invariant"
                         f"{'; missing ' + ', '.join(missing) if missing and isinstance(cls, type) else ''})")
    return cls


class PerRequestLogitsProcessor(LogitsProcessor):
    """A processor whose state is one value per batch index (None: the row is left alone), kept through
    `update_state` as the persistent batch tells it; subclasses give `row_state`, `apply` and
    `is_argmax_invariant`. vLLM's built-in min_tokens, logit_bias and min_p are written on it
    (vllm_neuron/worker/builtin_logits_processors.py)."""

    def __init__(self, vllm_config: Any = None, device: Any = None, is_pin_memory: bool = False) -> None:
        self.rows: dict[int, Any] = {}

    @abstractmethod
    def row_state(self, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int]) -> Any:
        """The row's state for this processor, or None when the request does not use it."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, params, prompt, output in batch_update.added:
            state = self.row_state(params, prompt, output)
            if state is None:
                self.rows.pop(i, None)
            else:
                self.rows[i] = state
        for a, b, direction in batch_update.moved:
            at_a, at_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if at_a is not None:
                self.rows[b] = at_a
            if direction is MoveDirectionality.SWAP and at_b is not None:
                self.rows[a] = at_b
