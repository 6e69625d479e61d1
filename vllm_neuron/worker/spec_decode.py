"""MRv1's speculative decoding: the verification graph per (decode batch bucket, K), its inputs and
randomness, and the drafts proposed after every step.

A decode step whose chunks carry drafts runs `verify_b{B}_k{K}`: the target's forward over 1 + K rows
per sequence (K/V of the last token and the drafts written in place), logits at every row, the
grammar bitmask at every verified position, and the rejection sampler - all in one compiled graph.
Steps without drafts run the ordinary decode graph, so a workload the proposer finds nothing in
costs nothing extra. Requests whose tokens need host sampling (penalties, logprobs, ...) get no
drafts: their rows are plain one-token rows of the same graph. Grammar requests speculate: the engine
walks the matcher through the drafts for the masks of every position and rolls it back.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_neuron.config.speculative import SpeculativeConfig
from vllm_neuron.logger import init_logger, warning_once
from vllm_neuron.model.layers.attention import AttentionMetadata, verify_mask
from vllm_neuron.model.layers.rejection_sampler import rejection_sample
from vllm_neuron.model.layers.in_graph_sampler import apply_token_bitmask, counter_uniform
from vllm_neuron.sampling_params import SAMPLING_EPS
from vllm_neuron.spec_decode.ngram_proposer import propose_ngram
from vllm_neuron.worker.graphs import StepGraphs

# Speculative draws hash positions from here on, apart from plain sampling's (the token's position).
_SPEC_STREAM = 1 << 31

logger = init_logger(__name__)


def verify_bucket_name(batch: int, k: int, context: int | None) -> str:
    return f"verify_b{batch}_k{k}" + (f"_c{context}" if context else "")


class VerifyGraphs(StepGraphs):
    """The verification graph function (tensors in, tensors out), beside MRv1's prefill and decode."""

    def verify(self, input_ids, positions, slot_mapping, block_tables, draft_ids, num_drafts, bitmask,
               temperature, top_k, top_p, uniform_accept, uniform_sample, kv_caches, groups=()):
        tokens, num_emitted, logits0, _, _ = self._verify(
            input_ids, positions, slot_mapping, block_tables, draft_ids, num_drafts, bitmask, temperature, top_k,
            top_p, uniform_accept, uniform_sample, kv_caches, groups)
        return tokens, num_emitted, logits0

    def _target_forward(self, input_ids, positions, kv_caches, meta, group_metas=()):
        """(hidden, extra): extra is what a draft model reads from the target (None for n-gram)."""
        return self._forward(input_ids, positions, kv_caches, meta, group_metas), None

    def _verify(self, input_ids, positions, slot_mapping, block_tables, draft_ids, num_drafts, bitmask,
                temperature, top_k, top_p, uniform_accept, uniform_sample, kv_caches, groups=()):
        b, k = draft_ids.shape
        if self.use_kernels:
            starts = torch.arange(b + 1, device=positions.device) * (k + 1)
            meta = AttentionMetadata(slot_mapping, block_tables=block_tables, query_start=starts, positions=positions,
                                     block_size=self.block_size, is_decode=True, use_kernels=True)
        else:
            mask = verify_mask(positions.view(b, k + 1), block_tables.shape[1] * self.block_size)
            meta = AttentionMetadata(slot_mapping, mask, block_tables=block_tables, is_decode=True, positions=positions)
        hidden, extra = self._target_forward(input_ids, positions, kv_caches, meta,
                                             self._group_metas(meta, groups, False))
        logits = self.model.compute_logits(hidden).float().view(b, k + 1, -1)
        if bitmask is not None:  # [B * (1 + K), words]: the grammar's mask at every verified position
            logits = apply_token_bitmask(logits.view(b * (k + 1), -1), bitmask).view(b, k + 1, -1)
        tokens, num_emitted = rejection_sample(
            logits, draft_ids, num_drafts, temperature, top_k, top_p, uniform_accept, uniform_sample,
            all_greedy=self.odsc.all_greedy, max_top_k=self.odsc.top_k)
        return tokens, num_emitted, logits[:, 0], meta, extra


class SpecDecoder:
    """Proposes drafts (n-gram) from each request's tokens and draws the verification's uniforms."""

    def __init__(self, spec: SpeculativeConfig, max_model_len: int) -> None:
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.max_model_len = max_model_len
        logger.info("Speculative decoding: %s; verification graphs verify_b{B}_k%d", spec.describe(), self.k)

    def propose(self, states, req_ids) -> dict[str, list[int]]:
        """Drafts for the next step of each request in req_ids (absent: none)."""
        out = {}
        for rid in req_ids:
            st = states.get(rid)
            if st is None or not self._eligible(st):
                continue
            tokens = st.data.prompt_token_ids + st.output_token_ids
            if len(tokens) >= self.max_model_len - 1:
                continue
            drafts = propose_ngram(tokens, self.spec.prompt_lookup_min, self.spec.prompt_lookup_max, self.k)
            if drafts:
                out[rid] = drafts
        return out

    def take(self, states, rows: dict[str, int], drafts: list[list[int]]) -> dict[str, list[int]]:
        """A draft model's proposals: request -> its row of `drafts`, for the requests that may speculate."""
        out = {}
        for rid, i in rows.items():
            st = states.get(rid)
            if st is not None and self._eligible(st) and st.next_position < self.max_model_len - 1:
                out[rid] = drafts[i]
        return out

    @staticmethod
    def _eligible(st) -> bool:
        if st.on_host:
            warning_once(logger, "Speculative decoding is off for requests that need host sampling (penalties, "
                         "logprobs, min_tokens, logit_bias, ...): they decode one token per step")
            return False
        return True

    def uniforms(self, states, req_ids: list[str], rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(accept [rows, K], sample [rows, K + 1]) uniforms: counter_uniform of the request's seed, on a
        stream of positions apart from plain sampling's, so a row's draws depend on nothing else."""
        k = self.k
        acc = np.zeros((rows, k), np.float32)
        smp = np.zeros((rows, k + 1), np.float32)
        for i, rid in enumerate(req_ids):
            st = states[rid]
            if st.on_host or st.params.temperature < SAMPLING_EPS:
                continue
            pos = _SPEC_STREAM + st.next_position * (2 * k + 1) + torch.arange(2 * k + 1)
            u = counter_uniform(torch.full((2 * k + 1,), st.seed), pos).numpy()
            acc[i], smp[i] = u[:k], u[k:]
        return acc, smp
