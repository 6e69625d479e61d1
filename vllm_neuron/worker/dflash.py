"""MRv1's DFlash speculative decoding: the bucket graphs with the block-parallel draft inside them.

Every graph of the step (prefill, decode, verify) taps the target's hidden states, injects each row's
context K/V into every draft layer's cache (at the row's own slot: the draft's caches are the last
`num_layers` entries of `kv_caches`, on the target's blocks), then runs ONE draft forward over a
`[bonus, mask x K]` block per sequence and returns its K drafts (the argmax of rows 1..K):

* prefill: the block follows each chunk's last row (its sampled token is the bonus);
* decode: the block follows the step's row;
* verify: the block follows each sequence's last emitted token (the rejected rows' context K/V lies
  where the block writes, so it is overwritten before anything reads it as context).

The block is non-causal: its rows attend to the context and to every row of the block. Each row's
attention limit is the block's last position (the metadata's `positions`), while RoPE uses the row's
real position, so the kernel and the torch path both serve it as a verification-shaped attention.
The block's K/V is written at its positions' slots; where the table has no block there (block 0, or
past the table's width) it goes to scratch blocks of the row's own, past the pool (`scratch_blocks`),
so no block row ever lands in another sequence's or the null block. Context K/V for any position is
written by the same graph that runs the target there, so prefix-cached blocks carry valid draft K/V.
"""
from __future__ import annotations

import numpy as np
import torch

from vllm_neuron.model.layers.attention import AttentionMetadata, verify_mask
from vllm_neuron.worker.draft_graphs import DraftModelGraphs


def scratch_blocks(k: int, block_size: int) -> int:
    """Scratch blocks per block row set: a block of K + 1 positions spans at most this many blocks."""
    return (block_size - 1 + k) // block_size + 1


class DFlashGraphs(DraftModelGraphs):
    def __init__(self, model, odsc, block_size: int, use_kernels: bool, paged_decode: bool, kv_layout, draft,
                 aux_layers: tuple[int, ...], k: int, scratch_rows: int) -> None:
        super().__init__(model, odsc, block_size, use_kernels, paged_decode, kv_layout, draft, aux_layers, k,
                         draft.cfg.num_layers)
        self.scratch_rows = scratch_rows  # rows the scratch area serves (the largest batch of blocks)
        self.scratch = scratch_blocks(k, block_size)

    def _block_tables(self, tables, start, num_slots: int) -> torch.Tensor:
        """The tables the block reads and writes through: unallocated columns from the block's first
        one on (and S extra columns) point at the row's scratch blocks."""
        rows, width = tables.shape
        s, bs = self.scratch, self.block_size
        t = torch.cat([tables, torch.zeros((rows, s), dtype=tables.dtype, device=tables.device)], dim=1)
        col = torch.arange(width + s, device=tables.device)[None, :]
        first = (start // bs)[:, None]
        base = num_slots // bs - self.scratch_rows * s
        row = torch.arange(rows, device=tables.device)[:, None]
        scratch = base + row * s + (col - first).clamp(0, s - 1)
        return torch.where((t == 0) & (col >= first), scratch, t)

    def _propose(self, bonus, start, tables, kv_caches) -> torch.Tensor:
        """[B, K] drafts of blocks [bonus, mask...] at positions start..start + K."""
        b, k1 = bonus.shape[0], self.k + 1
        caches = kv_caches[-self.num_draft_kv:]
        tables = self._block_tables(tables, start, caches[0][0].shape[0])
        pos = (start[:, None] + torch.arange(k1, device=start.device)[None, :]).reshape(-1)
        rows = torch.arange(b, device=start.device).repeat_interleave(k1)
        slots = tables[rows, pos // self.block_size] * self.block_size + pos % self.block_size
        limit = (start + self.k).repeat_interleave(k1)  # every row sees the whole block: non-causal
        if self.use_kernels:
            meta = AttentionMetadata(slots, block_tables=tables, query_start=torch.arange(b + 1, device=pos.device) * k1,
                                     positions=limit, block_size=self.block_size, is_decode=True, use_kernels=True)
        else:
            meta = AttentionMetadata(slots, verify_mask(limit.view(b, k1), tables.shape[1] * self.block_size),
                                     block_tables=tables, is_decode=True, positions=limit)
        ids = torch.full((b, k1), self.draft.cfg.mask_token_id, dtype=bonus.dtype, device=bonus.device)
        ids[:, 0] = bonus
        hidden = self.draft.block(ids.reshape(-1), pos, caches, meta, self.model.model.embed_tokens)
        rest = hidden.view(b, k1, -1)[:, 1:].reshape(b * self.k, -1)
        return self.draft.draft_tokens(rest, self.model.compute_logits).view(b, self.k)

    def _inject(self, aux, positions, slot_mapping, kv_caches) -> None:
        self.draft.write_context(aux, positions, slot_mapping, kv_caches[-self.num_draft_kv:])

    def prefill(self, input_ids, positions, slot_mapping, query_seq, attn_a, attn_b, logits_indices, bitmask,
                temperature, top_k, top_p, uniform, draft_tables, kv_caches):
        tokens, logits, aux, meta = self._tapped_prefill(input_ids, positions, slot_mapping, query_seq, attn_a, attn_b,
                                                         logits_indices, bitmask, temperature, top_k, top_p, uniform,
                                                         kv_caches)
        self._inject(aux, positions, slot_mapping, kv_caches)
        drafts = self._propose(tokens, positions[logits_indices] + 1, draft_tables, kv_caches)
        return tokens, logits, drafts

    def decode(self, input_ids, positions, slot_mapping, block_tables, bitmask, temperature, top_k, top_p,
               uniform, kv_caches):
        tokens, logits, aux, meta = self._tapped_decode(input_ids, positions, slot_mapping, block_tables, bitmask,
                                                        temperature, top_k, top_p, uniform, kv_caches)
        self._inject(aux, positions, slot_mapping, kv_caches)
        return tokens, logits, self._propose(tokens, positions + 1, block_tables, kv_caches)

    def verify(self, input_ids, positions, slot_mapping, block_tables, draft_ids, num_drafts, bitmask,
               temperature, top_k, top_p, uniform_accept, uniform_sample, kv_caches):
        tokens, num_emitted, logits0, meta, aux = self._verify(
            input_ids, positions, slot_mapping, block_tables, draft_ids, num_drafts, bitmask, temperature, top_k,
            top_p, uniform_accept, uniform_sample, kv_caches)
        self._inject(aux, positions, slot_mapping, kv_caches)
        b, k1 = tokens.shape
        rows, last = torch.arange(b, device=tokens.device), (num_emitted - 1).clamp(min=0)
        bonus = tokens[rows, last].clamp(min=0)  # the last emitted token: not through the target yet
        start = positions.view(b, k1)[rows, last] + 1
        return tokens, num_emitted, logits0, self._propose(bonus, start, block_tables, kv_caches)


def prefill_draft_tables(chunks, rows: int, width: int) -> np.ndarray:
    """[rows, width]: the block table of each prefill chunk's sequence (row i = chunk i), zeros elsewhere."""
    out = np.zeros((rows, width), np.int64)
    for i, ch in enumerate(chunks):
        n = min(len(ch.block_ids), width)
        out[i, :n] = ch.block_ids[:n]
    return out
