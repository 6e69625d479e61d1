"""vLLM V1's built-in logits processors (min_tokens, logit_bias, min_p) with the custom processors' batch-level
interface (vllm_neuron/logits_processor.py).

The host sampler (worker/host_sampler.py) applies these three request options only through these classes, so
the built-in behaviour and a processor written against the same interface are one code path. Each keeps its
per-row setting by batch index from `update_state`, as vLLM's persistent batch tells it (removed, added,
moved), and edits only the rows that set its option.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from vllm_neuron.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm_neuron.sampling_params import SamplingParams


class _PerRowProcessor(LogitsProcessor):
    """A processor whose state is one value per batch index, None for rows it leaves alone."""

    def __init__(self, vllm_config: Any = None, device: Any = None, is_pin_memory: bool = False) -> None:
        self.rows: dict[int, Any] = {}

    @abstractmethod
    def row_state(self, params: SamplingParams, output_token_ids: list[int]) -> Any:
        """The row's state for this processor, or None when the request does not use it."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.rows.pop(i, None)
        for i, params, _prompt, output in batch_update.added:
            state = self.row_state(params, output)
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


class MinTokensLogitsProcessor(_PerRowProcessor):
    """Until a request has `min_tokens` output tokens, its stop tokens (EOS and stop_token_ids:
    `SamplingParams.all_stop_token_ids`) are -inf."""

    def row_state(self, params: SamplingParams, output_token_ids: list[int]) -> Any:
        stops = params.all_stop_token_ids
        if params.min_tokens <= 0 or not stops:
            return None
        return params.min_tokens, list(stops), output_token_ids  # the live list: its length is read each step

    def is_argmax_invariant(self) -> bool:
        return False

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        for i, (min_tokens, stops, output) in self.rows.items():
            if len(output) < min_tokens:
                rows += [i] * len(stops)
                cols += stops
        if rows:
            logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
        return logits


class LogitBiasLogitsProcessor(_PerRowProcessor):
    """Adds each request's `logit_bias` {token id: bias} to its row."""

    def row_state(self, params: SamplingParams, output_token_ids: list[int]) -> Any:
        return dict(params.logit_bias) if params.logit_bias else None

    def is_argmax_invariant(self) -> bool:
        return False

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        rows = [i for i, bias in self.rows.items() for _ in bias]
        cols = [t for bias in self.rows.values() for t in bias]
        vals = [v for bias in self.rows.values() for v in bias.values()]
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)
        return logits


class MinPLogitsProcessor(_PerRowProcessor):
    """-inf for the tokens whose probability is below `min_p` times the row's largest; applied to
    temperature-scaled logits, as vLLM's sampler does. Greedy rows keep their argmax."""

    def row_state(self, params: SamplingParams, output_token_ids: list[int]) -> Any:
        return params.min_p if params.min_p > 0.0 else None

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        idx = list(self.rows)
        min_p = torch.tensor([self.rows[i] for i in idx], dtype=torch.float32, device=logits.device)
        probs = torch.softmax(logits[idx].float(), dim=-1)
        below = probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        logits[idx] = logits[idx].masked_fill(below, float("-inf"))
        return logits


# vLLM's split: the edits that can change a greedy token run before the penalties; min_p after temperature.
ARGMAX_CHANGING = (MinTokensLogitsProcessor, LogitBiasLogitsProcessor)
BUILTIN_LOGITS_PROCESSORS = (*ARGMAX_CHANGING, MinPLogitsProcessor)


def one_step_update(params: list[SamplingParams], prompts: list[list[int]],
                    outputs: list[list[int]]) -> BatchUpdate:
    """The BatchUpdate of a batch that is entirely new this step (the host sampler's rows)."""
    added = [(i, p, q, o) for i, (p, q, o) in enumerate(zip(params, prompts, outputs))]
    return BatchUpdate(len(params), (), added, ())
