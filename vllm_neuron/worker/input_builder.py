"""Padded, fixed-shape host arrays of one step's graph inputs (pure numpy; the runners turn them into
worker/step_inputs.py's tensors).

Padding conventions (shared with the attention layer):
* padded tokens write their K/V into the null block (slot 0) and belong to sequence -1, so they
  attend only to each other and stay finite;
* padded context slots belong to sequence -2 and are never attended;
* padded decode rows have seq_len 1 and a block table of null blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_neuron.step import ScheduledChunk


def token_slots(block_ids: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    pos = np.arange(start, end)
    return np.asarray(block_ids, dtype=np.int64)[pos // block_size] * block_size + pos % block_size


@dataclass
class PrefillArrays:
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    slot_mapping: np.ndarray  # [T]
    query_seq: np.ndarray  # [T]
    context_slots: np.ndarray | None  # [C]
    context_seq: np.ndarray | None  # [C]
    logits_indices: np.ndarray  # [R] row i = last token of chunk i
    # For the paged kernel (None unless asked for): chunk i's block table, its query rows.
    seq_tables: np.ndarray | None = None  # [R, max_blocks], null blocks past the table
    query_start: np.ndarray | None = None  # [R + 1]; chunk i owns rows query_start[i]..query_start[i + 1]


def build_prefill_inputs(chunks: list[ScheduledChunk], num_tokens: int, num_context: int, num_rows: int,
                         block_size: int, max_blocks: int = 0) -> PrefillArrays:
    """max_blocks > 0 also builds the kernel's per-sequence tables (`seq_tables`, `query_start`)."""
    ids = np.zeros(num_tokens, np.int64)
    pos = np.zeros(num_tokens, np.int64)
    slots = np.zeros(num_tokens, np.int64)
    qseq = np.full(num_tokens, -1, np.int64)
    rows = np.zeros(num_rows, np.int64)
    ctx_slots = np.zeros(num_context, np.int64) if num_context else None
    ctx_seq = np.full(num_context, -2, np.int64) if num_context else None
    t = c = 0
    for i, ch in enumerate(chunks):
        n = len(ch.token_ids)
        end = ch.start_pos + n
        ids[t:t + n] = ch.token_ids
        pos[t:t + n] = np.arange(ch.start_pos, end)
        slots[t:t + n] = token_slots(ch.block_ids, ch.start_pos, end, block_size)
        qseq[t:t + n] = i
        if ch.start_pos and num_context:  # the kernel path reads context through seq_tables instead
            ctx_slots[c:c + ch.start_pos] = token_slots(ch.block_ids, 0, ch.start_pos, block_size)
            ctx_seq[c:c + ch.start_pos] = i
            c += ch.start_pos
        t += n
        rows[i] = t - 1
    out = PrefillArrays(ids, pos, slots, qseq, ctx_slots, ctx_seq, rows)
    if max_blocks:
        out.seq_tables = np.zeros((num_rows, max_blocks), np.int64)
        out.query_start = np.full(num_rows + 1, t, np.int64)
        start = 0
        for i, ch in enumerate(chunks):
            nblk = min(len(ch.block_ids), max_blocks)
            out.seq_tables[i, :nblk] = ch.block_ids[:nblk]
            out.query_start[i] = start
            start += len(ch.token_ids)
    return out


@dataclass
class DecodeArrays:
    input_ids: np.ndarray  # [B]
    positions: np.ndarray  # [B]
    slot_mapping: np.ndarray  # [B]
    block_tables: np.ndarray  # [B, C // block_size]
    seq_lens: np.ndarray  # [B] including the new token


def build_decode_inputs(chunks: list[ScheduledChunk], batch: int, context: int, block_size: int) -> DecodeArrays:
    ids = np.zeros(batch, np.int64)
    pos = np.zeros(batch, np.int64)
    slots = np.zeros(batch, np.int64)
    tables = np.zeros((batch, context // block_size), np.int64)
    lens = np.ones(batch, np.int64)
    for i, ch in enumerate(chunks):
        p = ch.start_pos
        ids[i] = ch.token_ids[0]
        pos[i] = p
        slots[i] = ch.block_ids[p // block_size] * block_size + p % block_size
        nblk = -(-(p + 1) // block_size)
        tables[i, :nblk] = ch.block_ids[:nblk]
        lens[i] = p + 1
    return DecodeArrays(ids, pos, slots, tables, lens)
