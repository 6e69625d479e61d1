"""Pooling models on the prefill path: the component a runner calls instead of sampling (`--runner pooling`).

A pooling engine compiles prefill buckets only (`PoolingGraphs.prefill`: the model's forward, the hidden
states of every token of the step out, no logits, no sampling; no decode graph exists). Requests are batched
by token count like any prefill, and a prompt longer than a step is segmented: its chunks' K/V stay in its own
blocks for the next chunk's causal attention (prefix caching is off for pooling engines), and `Pooler` carries
its pooled state across them - the first token's hidden state (CLS), a running sum and count (MEAN), or
nothing until the last chunk (LAST). When a request's last chunk has run, its pooled hidden state goes through
the head: an embedding (Matryoshka truncation, L2 norm) or a classifier's logits (the model's
`classify_logits`) and activation. The result, a float32 CPU tensor, is the request's whole output.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_neuron.config.pooler_config import PoolingSetup
from vllm_neuron.model.layers.pooler import classifier_activation, embedding_head
from vllm_neuron.step import NewRequestData, ScheduledChunk
from vllm_neuron.worker.graphs import GraphBase
from vllm_neuron.worker.step_inputs import PrefillInputs


class PoolingGraphs(GraphBase):
    """The prefill bucket graph of a pooling engine: hidden states [T, hidden] of the step's tokens."""

    def prefill(self, x: PrefillInputs) -> torch.Tensor:
        meta = self.prefill_meta(x)
        kwargs = {**x.model_kwargs, "query_seq": x.query_seq} if getattr(self.model, "bidirectional", False) \
            else x.model_kwargs
        hidden, _ = self.forward(x.input_ids, x.positions, x.kv_caches, meta, self._group_metas(meta, x.groups, True),
                                 kwargs)
        return hidden


@dataclass
class _Pooled:
    """One request's pooling state across its prefill chunks."""

    params: object  # PoolingParams (task filled in by the input processor)
    first: torch.Tensor | None = None  # CLS: the first prompt token's hidden state
    total: torch.Tensor | None = None  # MEAN: the sum of the hidden states so far (float32)
    count: int = 0


class Pooler:
    def __init__(self, setup: PoolingSetup) -> None:
        self.setup = setup
        self.model = None  # set by the runner once built (classify_logits)
        self.states: dict[str, _Pooled] = {}

    def add(self, data: NewRequestData) -> None:
        if data.pooling_params is None:
            raise ValueError(f"request {data.req_id} has no pooling_params: a pooling engine only pools")
        self.states[data.req_id] = _Pooled(data.pooling_params)

    def remove(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    def restart(self, req_id: str) -> None:
        """A request rolled back (its K/V gone): its chunks run again from the first."""
        st = self.states.get(req_id)
        if st is not None:
            self.states[req_id] = _Pooled(st.params)

    def pool(self, chunks: list[ScheduledChunk], hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Takes the step's hidden states [T, hidden] (rows in chunk order, padding after them); returns the
        outputs of the requests whose last chunk this was."""
        kind = self.setup.pooling_type
        done: list[tuple[str, torch.Tensor]] = []
        t = 0
        for c in chunks:
            n = len(c.token_ids)
            rows = hidden[t:t + n]
            t += n
            st = self.states[c.req_id]
            if kind == "CLS" and c.start_pos == 0:
                st.first = rows[0].float()
            elif kind == "MEAN":
                s = rows.float().sum(0)
                st.total = s if st.total is None else st.total + s
                st.count += n
            if not c.sample:
                continue
            pooled = rows[-1].float() if kind == "LAST" else st.first if kind == "CLS" else st.total / st.count
            done.append((c.req_id, pooled))
        if not done:
            return {}
        return self._heads(done)

    def _heads(self, done: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        s = self.setup
        out: dict[str, torch.Tensor] = {}
        if s.task == "classify":
            with torch.inference_mode():
                logits = self.model.classify_logits(torch.stack([p for _, p in done]), s.classifier_token_ids)
        for i, (rid, pooled) in enumerate(done):
            p = self.states[rid].params
            if s.task == "embed":
                dims = p.dimensions if p.dimensions is not None else s.dimensions
                value = embedding_head(pooled, dims, s.normalize if p.normalize is None else p.normalize)
            else:
                value = classifier_activation(logits[i], s.use_activation if p.use_activation is None
                                              else p.use_activation)
            out[rid] = value.detach().to("cpu", torch.float32)
        return out
