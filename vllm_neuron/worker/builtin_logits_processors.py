"""vLLM V1's built-in logits processors (min_tokens, logit_bias, min_p) with the custom processors' batch-level
interface (vllm_neuron/logits_processor.py).

The host sampler (worker/host_sampler.py) applies these three request options only through these classes, so
the built-in behaviour and a processor written against the same interface are one code path. Each keeps its
per-row setting by batch index from `update_state`, as vLLM's persistent batch tells it (removed, added,
moved), and edits only the rows that set its option.
"""
from __future__ import annotations

from typing import Any

import torch

from vllm_neuron.logits_processor import BatchUpdate, PerRequestLogitsProcessor
from vllm_neuron.sampling_params import SamplingParams


class MinTokensLogitsProcessor(PerRequestLogitsProcessor):
    """Until a request has `min_tokens` output tokens, its stop tokens (EOS and stop_token_ids:
    `SamplingParams.all_stop_token_ids`) are -inf."""

    def row_state(self, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int]) -> Any:
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


class LogitBiasLogitsProcessor(PerRequestLogitsProcessor):
    """Adds each request's `logit_bias` {token id: bias} to its row."""

    def row_state(self, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int]) -> Any:
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


class MinPLogitsProcessor(PerRequestLogitsProcessor):
    """-inf for the tokens whose probability is below `min_p` times the row's largest; applied to
    temperature-scaled logits, as vLLM's sampler does. Greedy rows keep their argmax."""

    def row_state(self, params: SamplingParams, prompt_token_ids: list[int], output_token_ids: list[int]) -> Any:
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
