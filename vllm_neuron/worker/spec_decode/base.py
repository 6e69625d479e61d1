"""The speculator interface: one object per speculative method, chosen once at start-up, that Model Runner
V1 calls at fixed points. The runner holds a speculator or None and never asks which method it is.

At set-up: `load` (a draft model beside the target, its bytes), `kv_layers` / `kv_extra_slots` (KV the
draft keeps in the target's blocks), `draft_graphs` (its part inside every bucket graph), `graph_options`
(what of it shapes those graphs: part of the compile-cache key), `step_context` (how much block table a
decode step's graph must reach). Every step: `prefill_inputs` (what its in-graph part reads in a prefill),
`propose` (the next step's drafts, from the host's tokens or from the graph's draft rows), `uniforms` (the
verification's random numbers).

A decode step whose chunks carry drafts runs the `verify_b{B}_k{K}` graph (worker/graphs.py: the target over
1 + K rows per sequence and the rejection sampler); steps without drafts run the ordinary decode graph.
Requests that need host sampling (penalties, logprobs, ...) get no drafts: their rows are one-token rows of
the same graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_neuron.config.speculative import SpeculativeConfig
from vllm_neuron.logger import init_logger, warning_once
from vllm_neuron.model.layers.kernel_config import KernelConfig
from vllm_neuron.sampling_params import SAMPLING_EPS
from vllm_neuron.step import ScheduledChunk
from vllm_neuron.worker.graphs import DraftGraphs
from vllm_neuron.worker.sampling_state import RequestState
from vllm_neuron.worker.spec_decode.verify_inputs import verify_uniforms

logger = init_logger(__name__)


@dataclass(frozen=True)
class Target:
    """What a speculator may know of the target it drafts for."""

    model: torch.nn.Module
    num_layers: int
    vocab_size: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    kernels: KernelConfig
    max_model_len: int
    block_size: int
    max_rows: int  # the most sequences a decode step holds (max_num_seqs or the largest decode bucket)


class Speculator:
    method = ""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.max_model_len = max_model_len

    # -- set-up ---------------------------------------------------------------------------------------
    def load(self, target: Target) -> int:
        """Loads what the method needs beside the target; returns the bytes loaded."""
        return 0

    def kv_layers(self) -> list[tuple[int, int]]:
        """(kv heads, head dim) of the draft's KV layers, in the target's blocks and slots."""
        return []

    def kv_extra_slots(self) -> int:
        """Slots those layers hold past the pool's."""
        return 0

    def draft_graphs(self) -> DraftGraphs | None:
        """The method's part inside every bucket graph (None: it proposes on the host)."""
        return None

    def graph_options(self) -> dict:
        """What of the method shapes the bucket graphs (part of the compile-cache key)."""
        return {}

    def kv_groups_unsupported(self) -> str | None:
        """Why the method cannot serve a model with several KV cache groups (None: it can)."""
        return None

    def describe(self) -> str:
        return self.spec.describe()

    # -- every step -----------------------------------------------------------------------------------
    def step_context(self, max_seq_len: int) -> int:
        """Positions a decode step's graph reaches in the block table (its context bucket is chosen for it)."""
        return max_seq_len

    def prefill_inputs(self, chunks: list[ScheduledChunk], num_tokens: int, rows: int,
                       all_tokens) -> Any:
        """Host arrays the in-graph part reads in a prefill (None: nothing). all_tokens(req_id): a request's
        prompt and output tokens so far."""
        return None

    def propose(self, states: dict[str, RequestState], wanted: list[str], rows: dict[str, int],
                graph_drafts: torch.Tensor | None) -> dict[str, list[int]]:
        """The next step's drafts of the requests in `wanted` (absent: none); `rows` maps a request to its row
        of the step's output, `graph_drafts` is the graph's draft rows (None: no in-graph part)."""
        raise NotImplementedError

    def uniforms(self, states: dict[str, RequestState], req_ids: list[str], rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(accept [rows, K], sample [rows, K + 1]) uniforms of a verification step."""
        seeds = [None if states[r].on_host or states[r].params.temperature < SAMPLING_EPS else states[r].seed
                 for r in req_ids]
        return verify_uniforms(seeds, [states[r].next_position for r in req_ids], self.k, rows)

    # -- shared by the methods ------------------------------------------------------------------------
    def eligible(self, st: RequestState | None) -> bool:
        """Whether a request may speculate: known here, sampled in the graph, room for a draft."""
        if st is None:
            return False
        if st.on_host:
            warning_once(logger, "Speculative decoding is off for requests that need host sampling (penalties, "
                         "logprobs, min_tokens, logit_bias, ...): they decode one token per step")
            return False
        return st.next_position < self.max_model_len - 1
