"""MRv1's side of async scheduling: feeding the previous step's sampled tokens to the next decode step.

With async scheduling the scheduler plans step N+1 before step N's tokens reach it, so decode chunks
carry `PLACEHOLDER_TOKEN_ID`. When step N+1 is the same decode batch in the same order (the steady
state), the graph's token tensor of step N is the next input as is: no host round trip. Otherwise
(requests joined, left or were reordered, or a row was sampled on the host) the flow breaks: the
placeholders are filled from step N's tokens on the host and the step counts as a sync fallback.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vllm_neuron.step import PLACEHOLDER_TOKEN_ID, ScheduledChunk


@dataclass
class _LastStep:
    req_ids: list[str]  # rows of `graph_tokens`, in order (decode: the whole batch)
    graph_tokens: torch.Tensor | None  # [bucket] the graph's sampled tokens, padded rows included
    final: dict[str, int]  # the tokens actually emitted (host-sampled rows differ from the graph's)
    passable: bool  # graph_tokens can be fed as is (a decode step whose rows were all graph-sampled)


class TokenPassing:
    def __init__(self) -> None:
        self.last: _LastStep | None = None

    def record(self, kind: str, req_ids: list[str], graph_tokens: torch.Tensor | None, final: dict[str, int],
               host_rows: bool) -> None:
        passable = kind == "decode" and graph_tokens is not None and not host_rows
        self.last = _LastStep(req_ids, graph_tokens, final, passable)

    def resolve(self, chunks: list[ScheduledChunk], bucket: int
                ) -> tuple[list[ScheduledChunk], torch.Tensor | None, bool]:
        """(chunks with placeholders filled, device input ids to use or None, whether it fell back).

        Chunks without placeholders come back unchanged with no fallback."""
        if all(c.token_ids[0] != PLACEHOLDER_TOKEN_ID for c in chunks):
            return chunks, None, False
        last = self.last
        if last is None:
            raise RuntimeError("a decode step holds placeholder tokens but no earlier step sampled them")
        ids = [c.req_id for c in chunks]
        if last.passable and last.req_ids == ids and last.graph_tokens.shape[0] == bucket:
            return chunks, last.graph_tokens, False
        filled = []
        for c in chunks:
            if c.token_ids[0] == PLACEHOLDER_TOKEN_ID:
                if c.req_id not in last.final:
                    raise RuntimeError(f"request {c.req_id}: its placeholder token was not sampled by the "
                                       "previous step")
                c = dataclasses.replace(c, token_ids=[last.final[c.req_id]])
            filled.append(c)
        return filled, None, True
