"""Padded, fixed-shape inputs of a verification step: 1 + K query rows per sequence, its graph's bucket
name, and the rejection sampler's random numbers (pure numpy, but for the counter hash).

Row layout: sequence i owns rows i * (K + 1) .. i * (K + 1) + K: its last verified token, then its
drafts. A sequence with n < K drafts pads its last K - n rows with token 0 at the position of its last
real row and writes their K/V into the null slot 0: the scheduler allocated slots for 1 + n tokens
only, and the padded rows' outputs are never used (the rejection sampler stops at n). Padded
sequences are all-null, like padded decode rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_neuron.model.layers.in_graph_sampler import counter_uniform
from vllm_neuron.step import ScheduledChunk

# Speculative draws hash positions from here on, apart from plain sampling's (the token's position).
_SPEC_STREAM = 1 << 31


def verify_bucket_name(batch: int, k: int, context: int | None) -> str:
    return f"verify_b{batch}_k{k}" + (f"_c{context}" if context else "")


@dataclass
class VerifyArrays:
    input_ids: np.ndarray  # [B * (K + 1)]
    positions: np.ndarray  # [B * (K + 1)]
    slot_mapping: np.ndarray  # [B * (K + 1)]
    block_tables: np.ndarray  # [B, table_width]
    draft_ids: np.ndarray  # [B, K]
    num_drafts: np.ndarray  # [B]


def build_verify_inputs(chunks: list[ScheduledChunk], batch: int, k: int, table_width: int,
                        block_size: int) -> VerifyArrays:
    rows = k + 1
    ids = np.zeros((batch, rows), np.int64)
    pos = np.zeros((batch, rows), np.int64)
    slots = np.zeros((batch, rows), np.int64)
    tables = np.zeros((batch, table_width), np.int64)
    drafts = np.zeros((batch, k), np.int64)
    num = np.zeros(batch, np.int64)
    for i, ch in enumerate(chunks):
        n = len(ch.token_ids)  # 1 + its drafts
        if n > rows:
            raise ValueError(f"request {ch.req_id} carries {n - 1} drafts; the graph verifies at most {k}")
        start = ch.start_pos
        ids[i, :n] = ch.token_ids
        pos[i, :n] = np.arange(start, start + n)
        pos[i, n:] = start + n - 1
        p = pos[i, :n]
        blocks = np.asarray(ch.block_ids, np.int64)
        slots[i, :n] = blocks[p // block_size] * block_size + p % block_size
        nblk = min(len(ch.block_ids), table_width)
        tables[i, :nblk] = ch.block_ids[:nblk]
        drafts[i, :n - 1] = ch.token_ids[1:]
        num[i] = n - 1
    return VerifyArrays(ids.reshape(-1), pos.reshape(-1), slots.reshape(-1), tables, drafts, num)


def verify_uniforms(seeds: list[int | None], next_positions: list[int], k: int,
                    rows: int) -> tuple[np.ndarray, np.ndarray]:
    """(accept [rows, K], sample [rows, K + 1]) uniforms of a verification: row i's from counter_uniform of its
    request's seed on a stream of positions apart from plain sampling's, so its draws depend on nothing else;
    zeros where the seed is None (a greedy or host-sampled row) and for padding rows."""
    acc = np.zeros((rows, k), np.float32)
    smp = np.zeros((rows, k + 1), np.float32)
    for i, (seed, pos) in enumerate(zip(seeds, next_positions)):
        if seed is None:
            continue
        p = _SPEC_STREAM + pos * (2 * k + 1) + torch.arange(2 * k + 1)
        u = counter_uniform(torch.full((2 * k + 1,), seed), p).numpy()
        acc[i], smp[i] = u[:k], u[k:]
    return acc, smp
