"""DFlash speculation: the block-parallel draft runs inside every bucket graph.

Every graph of the step (prefill, decode, verify) taps the target's hidden states, injects each row's
context K/V into every draft layer's cache (at the row's own slot: the draft's caches are `draft_kv`, on the
target's blocks), then runs ONE draft forward over a `[bonus, mask x K]` block per sequence and returns its K
drafts (the argmax of rows 1..K):

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

from vllm_neuron.model.dflash import load_dflash_draft
from vllm_neuron.worker.graphs import GraphBase
from vllm_neuron.worker.spec_decode.base import Target
from vllm_neuron.worker.spec_decode.draft_model import DraftModelSpeculator
from vllm_neuron.worker.step_inputs import DecodeInputs, PrefillInputs, VerifyInputs


def scratch_blocks(k: int, block_size: int) -> int:
    """Scratch blocks per block row set: a block of K + 1 positions spans at most this many blocks."""
    return (block_size - 1 + k) // block_size + 1


class DFlashSpeculator(DraftModelSpeculator):
    method = "dflash"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.target: Target | None = None

    def _load_draft(self, target: Target):
        self.target = target
        # Block rows reach K + 1 positions past the last verified one.
        draft, nbytes = load_dflash_draft(self.spec.model, target_layers=target.num_layers, k=self.k,
                                          max_positions=target.max_model_len + 2 * self.k + 2, dtype=target.dtype,
                                          device=target.device, target_vocab=target.vocab_size,
                                          target_hidden=target.hidden_size)
        return draft, nbytes, f"{draft.cfg.num_layers} non-causal layers over [bonus, {self.k} x mask] blocks"

    def kv_layers(self) -> list[tuple[int, int]]:
        return self.draft.kv_cache_specs()

    def kv_extra_slots(self) -> int:
        t = self.target
        return t.max_rows * scratch_blocks(self.k, t.block_size) * t.block_size

    def draft_graphs(self) -> "DFlashGraphs":
        return DFlashGraphs(self.draft, self.aux_layers, self.k, self.target.max_rows, self.target.block_size)

    def prefill_inputs(self, chunks, num_tokens: int, rows: int, all_tokens) -> np.ndarray:
        return prefill_draft_tables(chunks, rows, -(-self.max_model_len // self.target.block_size))


class DFlashGraphs:
    """DFlash's part of the bucket graphs (worker/graphs.py's DraftGraphs)."""

    def __init__(self, draft, aux_layers: tuple[int, ...], k: int, scratch_rows: int, block_size: int) -> None:
        self.draft = draft
        self.aux_layers = aux_layers
        self.k = k
        self.scratch_rows = scratch_rows  # rows the scratch area serves (the largest batch of blocks)
        self.scratch = scratch_blocks(k, block_size)

    def _block_tables(self, g: GraphBase, tables, start, num_slots: int) -> torch.Tensor:
        """The tables the block reads and writes through: unallocated columns from the block's first
        one on (and S extra columns) point at the row's scratch blocks."""
        rows, width = tables.shape
        s, bs = self.scratch, g.options.block_size
        t = torch.cat([tables, torch.zeros((rows, s), dtype=tables.dtype, device=tables.device)], dim=1)
        col = torch.arange(width + s, device=tables.device)[None, :]
        first = (start // bs)[:, None]
        base = num_slots // bs - self.scratch_rows * s
        row = torch.arange(rows, device=tables.device)[:, None]
        scratch = base + row * s + (col - first).clamp(0, s - 1)
        return torch.where((t == 0) & (col >= first), scratch, t)

    def _propose(self, g: GraphBase, bonus, start, tables, caches) -> torch.Tensor:
        """[B, K] drafts of blocks [bonus, mask...] at positions start..start + K."""
        b, k1, bs = bonus.shape[0], self.k + 1, g.options.block_size
        tables = self._block_tables(g, tables, start, caches[0][0].shape[0])
        pos = (start[:, None] + torch.arange(k1, device=start.device)[None, :]).reshape(-1)
        rows = torch.arange(b, device=start.device).repeat_interleave(k1)
        slots = tables[rows, pos // bs] * bs + pos % bs
        limit = (start + self.k).repeat_interleave(k1)  # every row sees the whole block: non-causal
        meta = g.rows_meta(slots, tables, limit, k1)
        ids = torch.full((b, k1), self.draft.cfg.mask_token_id, dtype=bonus.dtype, device=bonus.device)
        ids[:, 0] = bonus
        hidden = self.draft.block(ids.reshape(-1), pos, caches, meta, g.model.model.embed_tokens)
        rest = hidden.view(b, k1, -1)[:, 1:].reshape(b * self.k, -1)
        return self.draft.draft_tokens(rest, g.model.compute_logits).view(b, self.k)

    def after_prefill(self, g: GraphBase, x: PrefillInputs, tokens, taps, meta) -> torch.Tensor:
        self.draft.write_context(taps, x.positions, x.slot_mapping, x.draft_kv)
        return self._propose(g, tokens, x.positions[x.logits_indices] + 1, x.draft, x.draft_kv)

    def after_decode(self, g: GraphBase, x: DecodeInputs, tokens, taps, meta) -> torch.Tensor:
        self.draft.write_context(taps, x.positions, x.slot_mapping, x.draft_kv)
        return self._propose(g, tokens, x.positions + 1, x.block_tables, x.draft_kv)

    def after_verify(self, g: GraphBase, x: VerifyInputs, tokens, num_emitted, taps, meta) -> torch.Tensor:
        self.draft.write_context(taps, x.positions, x.slot_mapping, x.draft_kv)
        b, k1 = tokens.shape
        rows, last = torch.arange(b, device=tokens.device), (num_emitted - 1).clamp(min=0)
        bonus = tokens[rows, last].clamp(min=0)  # the last emitted token: not through the target yet
        start = x.positions.view(b, k1)[rows, last] + 1
        return self._propose(g, bonus, start, x.block_tables, x.draft_kv)


def prefill_draft_tables(chunks, rows: int, width: int) -> np.ndarray:
    """[rows, width]: the block table of each prefill chunk's sequence (row i = chunk i), zeros elsewhere."""
    out = np.zeros((rows, width), np.int64)
    for i, ch in enumerate(chunks):
        n = min(len(ch.block_ids), width)
        out[i, :n] = ch.block_ids[:n]
    return out
