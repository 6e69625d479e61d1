"""Prompt logprobs of a prefill step: which of its token rows the requests asked for, and the per-position
entries that go back to the engine (only requests with `prompt_logprobs` set; other steps do none of this).

Position p's row predicts prompt token p + 1, so a prompt of L tokens has L - 1 entries (position 0 has
nothing before it: vLLM's leading None). A segmented prefill yields each chunk's share; the engine core
joins them. A request that already sampled (recomputed after a preemption) asks for nothing: its prompt
logprobs went out with its first token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_neuron.step import ScheduledChunk
from vllm_neuron.worker.sampling_state import RequestState
from vllm_neuron.worker.step_inputs import PromptLogprobsOut, PromptRows

# (token_id, logprob, rank) of the prompt token, then the top-N: one position's entries (StepLogprobs' shape).
Entries = list[tuple[int, float, int]]


@dataclass
class PromptSpan:
    req_id: str
    start: int  # first prompt position of the chunk's share
    count: int
    top_n: int  # what the request asked for (its share of the step's top_n columns)


@dataclass
class PromptLogprobsPlan:
    rows: PromptRows
    spans: list[PromptSpan]


def plan_prompt_logprobs(chunks: list[ScheduledChunk], states: dict[str, RequestState], vocab_size: int,
                         device: torch.device) -> PromptLogprobsPlan | None:
    """The rows of this prefill step whose prompt logprobs are wanted; None when no request asks."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[PromptSpan] = []
    t = 0
    for c in chunks:
        st = states.get(c.req_id)
        n = len(c.token_ids)
        want = st.params.prompt_logprobs if st is not None else None
        if want is not None and not st.output_token_ids:
            prompt = st.data.prompt_token_ids
            end = min(c.start_pos + n, len(prompt) - 1)
            if end > c.start_pos:
                rows.extend(range(t, t + end - c.start_pos))
                targets.extend(prompt[c.start_pos + 1:end + 1])
                spans.append(PromptSpan(c.req_id, c.start_pos, end - c.start_pos,
                                        vocab_size if want == -1 else min(want, vocab_size)))
        t += n
    if not spans:
        return None
    top_n = max(s.top_n for s in spans)
    return PromptLogprobsPlan(PromptRows(torch.tensor(rows, dtype=torch.long, device=device),
                                         torch.tensor(targets, dtype=torch.long, device=device), top_n), spans)


def prompt_logprob_entries(plan: PromptLogprobsPlan, out: PromptLogprobsOut) -> dict[str, tuple[int, list[Entries]]]:
    """req_id -> (first position, one entry list per position) of this step."""
    lps, ranks = out.logprobs.tolist(), out.ranks.tolist()
    targets = plan.rows.targets.tolist()
    top_i = out.top_ids.tolist() if out.top_ids is not None else None
    top_v = out.top_logprobs.tolist() if out.top_logprobs is not None else None
    result: dict[str, tuple[int, list[Entries]]] = {}
    r = 0
    for span in plan.spans:
        positions = []
        for _ in range(span.count):
            entry = [(targets[r], lps[r], int(ranks[r]))]
            if span.top_n:
                entry += [(top_i[r][k], top_v[r][k], k + 1) for k in range(span.top_n)]
            positions.append(entry)
            r += 1
        result[span.req_id] = (span.start, positions)
    return result
