"""The per-bucket graph functions: tensors in, tensors out, nothing of requests or the host.

They live apart from the model runners so that what a compiled graph closes over is only the model
and a few static options. The compile cache serializes each bucket's compiled function together
with a snapshot of that closure for its guards, and the runner (RNG generators, host state) would
not survive the round trip.
"""
from __future__ import annotations

import dataclasses

import torch

from vllm_neuron.model.layers.attention import AttentionMetadata, context_positions, decode_mask, prefill_mask
from vllm_neuron.model.layers.in_graph_sampler import (apply_token_bitmask, counter_uniform, greedy_in_graph,
                                                       sample_in_graph)


class StepGraphs:
    """MRv1's graphs: host-built inputs; forward, logits of the sampled rows and in-graph sampling."""

    kv_segment = 0  # kv_segment_size_buckets: the torch prefill reads the context this many slots at a time

    def __init__(self, model: torch.nn.Module, odsc, block_size: int, use_kernels: bool,
                 paged_decode: bool = False, kv_layout=None) -> None:
        self.model = model
        self.odsc = odsc
        self.block_size = block_size
        self.use_kernels = use_kernels
        self.paged_decode = paged_decode
        # KV cache groups (kv_cache_groups.py): per layer its group and its K/V tensor pair; None for one
        # group, where kv_caches holds one pair per layer and every layer shares one metadata.
        multi = kv_layout is not None and kv_layout.num_groups > 1
        self.layer_group = kv_layout.layer_group() if multi else None
        self.layer_slot = kv_layout.layer_slot() if multi else None

    def _forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, group_metas=()):
        """The model's forward; with KV cache groups each layer gets its group's metadata (slots, tables)
        and the K/V pair it shares with the layers of the same index in the other groups."""
        if self.layer_slot is not None:
            metas = (meta, *group_metas)
            kv_caches = [kv_caches[s] for s in self.layer_slot]
            meta = [metas[g] for g in self.layer_group]
        return self.model(input_ids, positions, kv_caches, meta)

    def _group_metas(self, meta: AttentionMetadata, groups, prefill: bool) -> tuple:
        """Metadata of KV cache groups 1..: `groups` holds each one's (slot_mapping, tables), the tables being
        block tables (decode, kernel prefill) or context slots (torch prefill); masks are shared."""
        tables_field = "context_slots" if prefill and not self.use_kernels else "block_tables"
        return tuple(dataclasses.replace(meta, slot_mapping=sm, **{tables_field: t}) for sm, t in groups)

    def _sample(self, logits, bitmask, temperature, top_k, top_p, uniform):
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        if self.odsc is None:
            return None, logits
        if self.odsc.all_greedy:
            return greedy_in_graph(logits), logits
        return sample_in_graph(logits, temperature, top_k, top_p, uniform, self.odsc.top_k), logits

    def prefill_meta(self, slot_mapping, positions, query_seq, attn_a, attn_b) -> AttentionMetadata:
        """attn_a / attn_b: the kernel's (seq_tables, query_start), else (context_slots, context_seq)."""
        if self.use_kernels:
            return AttentionMetadata(slot_mapping, block_tables=attn_a, query_start=attn_b, positions=positions,
                                     block_size=self.block_size, use_kernels=True)
        return AttentionMetadata(slot_mapping, prefill_mask(positions, query_seq, attn_b), context_slots=attn_a,
                                 positions=positions,
                                 context_positions=None if attn_b is None else context_positions(attn_b),
                                 kv_segment=self.kv_segment)

    def decode_meta(self, slot_mapping, block_tables, positions) -> AttentionMetadata:
        if self.use_kernels:
            starts = torch.arange(positions.shape[0] + 1, device=positions.device)
            return AttentionMetadata(slot_mapping, block_tables=block_tables, query_start=starts, positions=positions,
                                     block_size=self.block_size, is_decode=True, use_kernels=True)
        if self.paged_decode:
            return AttentionMetadata(slot_mapping, block_tables=block_tables, positions=positions, is_decode=True,
                                     block_size=self.block_size, paged_decode=True)
        mask = decode_mask(positions + 1, block_tables.shape[1] * self.block_size)
        return AttentionMetadata(slot_mapping, mask, block_tables=block_tables, is_decode=True, positions=positions)

    def prefill(self, input_ids, positions, slot_mapping, query_seq, attn_a, attn_b,
                logits_indices, bitmask, temperature, top_k, top_p, uniform, kv_caches, groups=()):
        meta = self.prefill_meta(slot_mapping, positions, query_seq, attn_a, attn_b)
        hidden = self._forward(input_ids, positions, kv_caches, meta, self._group_metas(meta, groups, True))
        logits = self.model.compute_logits(hidden[logits_indices])
        return self._sample(logits, bitmask, temperature, top_k, top_p, uniform)

    def decode(self, input_ids, positions, slot_mapping, block_tables,
               bitmask, temperature, top_k, top_p, uniform, kv_caches, groups=()):
        meta = self.decode_meta(slot_mapping, block_tables, positions)
        hidden = self._forward(input_ids, positions, kv_caches, meta, self._group_metas(meta, groups, False))
        logits = self.model.compute_logits(hidden)
        return self._sample(logits, bitmask, temperature, top_k, top_p, uniform)


class StepGraphsV2(StepGraphs):
    """MRv2's graphs: per-request state lives in slot tensors that the graph reads and updates."""

    def _sample_rows(self, logits, bitmask, slots, sample_pos, temperature, top_k, top_p, seed):
        """In-graph tokens of the rows at `slots`; under CPU sampling the argmax stands in until the
        host's token overwrites it."""
        if self.odsc is None:
            _, logits = self._sample(logits, bitmask, None, None, None, None)
            return greedy_in_graph(logits), logits
        if self.odsc.all_greedy:
            return self._sample(logits, bitmask, None, None, None, None)
        uniform = counter_uniform(seed[slots], sample_pos)
        return self._sample(logits, bitmask, temperature[slots], top_k[slots], top_p[slots], uniform)

    @staticmethod
    def _write_token_state(slots, tokens, next_pos, last_token, position) -> None:
        # Padding rows all point at the dummy slot: force its state back to (token 0, position 0).
        dummy = slots == last_token.shape[0] - 1
        last_token.index_copy_(0, slots, torch.where(dummy, torch.zeros_like(tokens), tokens))
        position.index_copy_(0, slots, torch.where(dummy, torch.zeros_like(next_pos), next_pos))

    def prefill(self, input_ids, positions, slot_mapping, query_seq, attn_a, attn_b,
                logits_indices, bitmask, sample_slots, last_token, position, block_table, temperature,
                top_k, top_p, seed, kv_caches, groups=()):
        meta = self.prefill_meta(slot_mapping, positions, query_seq, attn_a, attn_b)
        hidden = self._forward(input_ids, positions, kv_caches, meta, self._group_metas(meta, groups, True))
        logits = self.model.compute_logits(hidden[logits_indices])
        next_pos = positions[logits_indices] + 1  # where the sampled token will sit
        tokens, logits = self._sample_rows(logits, bitmask, sample_slots, next_pos, temperature, top_k, top_p,
                                           seed)
        self._write_token_state(sample_slots, tokens, next_pos, last_token, position)
        return tokens, logits

    def decode(self, row_slots, context_cols, bitmask, last_token, position, block_table, temperature,
               top_k, top_p, seed, kv_caches, group_tables=()):
        """group_tables: the slot block tables of KV cache groups 1.. (BatchState.group_tables)."""
        ids = last_token[row_slots]
        pos = position[row_slots]

        def rows(table):  # (slot_mapping, [B, C // block_size] tables) of the batch's rows
            return (table[row_slots, pos // self.block_size] * self.block_size + pos % self.block_size,
                    table[row_slots[:, None], context_cols[None, :]])

        slot_mapping, tables = rows(block_table)
        meta = self.decode_meta(slot_mapping, tables, pos)
        hidden = self._forward(ids, pos, kv_caches, meta, self._group_metas(meta, [rows(t) for t in group_tables],
                                                                            False))
        logits = self.model.compute_logits(hidden)
        tokens, logits = self._sample_rows(logits, bitmask, row_slots, pos + 1, temperature, top_k, top_p, seed)
        self._write_token_state(row_slots, tokens, pos + 1, last_token, position)
        return tokens, logits
