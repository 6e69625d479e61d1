"""Paged attention over a per-layer KV cache, in two static-shape forms.

The cache of one layer is a pair of tensors [num_slots, kv_heads, head_dim] (slot = block * block_size
+ offset). Keeping one tensor per layer matters: writing through views of one big cache makes inductor
copy the whole cache per layer (FACTS.md).

* Prefill (T padded tokens, C padded context slots): the new K/V are written at `slot_mapping`; each
  token attends to the context slots of its own sequence (already in the cache: prefix-cache hits and
  earlier segments) plus the new tokens of its sequence up to its own position.
* Decode (B padded sequences, context bucket C): the new K/V are written, then each sequence's K/V is
  gathered through its block table to [B, kv, C, D]; query heads of one KV head are folded into the
  query-length axis of SDPA (faster on CPU than enable_gqa or repeat_interleave, FACTS.md). Speculative
  verification is the same with 1 + K query rows per sequence and a per-row causal mask.
* Paged decode (`paged_decode`, on CUDA; model/layers/paged_decode.py): one Triton kernel per decode
  step reads each sequence's K/V through its block table up to its own length, no gather and no mask
  (one query row per sequence: speculative verification keeps the masked path).
* With the custom kernel (model/layers/kernels; on by default on CPU) both cases are one call that
  reads each sequence's K/V in place through its block table, up to each query's real position: no
  gather, no mask, and a context bucket costs nothing beyond the tokens actually there.
* An FP8 cache (kv_quant.py) stores K / k_scale and V / v_scale: both forms dequantize what they read,
  the new tokens included, so a step sees exactly what later steps will.

Masks are built once per step by the model (`prefill_mask` / `decode_mask`) and shared by all layers.
Padding rows always see at least one finite key, so no NaN is ever produced or written.

Attention sinks (a learned per-head logit that takes part in the softmax and is then dropped, gpt-oss)
and sliding windows (a query sees the `window` most recent positions, itself included) run in the
kernel (it never reads keys before the window: a sliding-window KV cache group keeps null blocks
there) and on the torch path, where a layer's window narrows the shared mask with the key positions
(`positions`, `context_positions`). The CUDA paged decode does neither (ModelSpec: torch path then).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_neuron.model.layers import kv_quant
from vllm_neuron.model.layers.kernels import ops
from vllm_neuron.model.layers.paged_decode import paged_decode


@dataclass
class AttentionMetadata:
    """Per-step attention inputs; every tensor has a bucket-determined shape.

    Torch path: prefill uses `mask` [T, C + T] and `context_slots` [C] (None when C == 0); decode uses
    `mask` [B, 1, 1, C] and `block_tables` [B, C // block_size].
    Kernel path (`use_kernels`, a Python constant fixed per graph): `block_tables` [S, n] per sequence,
    `query_start` [S + 1] (sequence s owns query rows query_start[s]..query_start[s + 1]) and
    `positions` [N]; no mask and no gather.
    Paged decode (`paged_decode`, a constant too): `block_tables` [B, C // block_size] and `positions` [B].
    """

    slot_mapping: torch.Tensor  # [N] where each new token's K/V goes
    mask: torch.Tensor | None = None
    context_slots: torch.Tensor | None = None
    block_tables: torch.Tensor | None = None
    is_decode: bool = False
    use_kernels: bool = False
    query_start: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    block_size: int = 0
    paged_decode: bool = False
    context_positions: torch.Tensor | None = None  # torch prefill: [C] position of each context slot
    kv_segment: int = 0  # torch prefill: context read in segments of this many slots (0: all at once)

    def fields(self) -> tuple:
        """The fields in order, unpacked (a nested compile region takes tensors and constants, not
        dataclasses); `AttentionMetadata(*meta.fields())` rebuilds it."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def prefill_mask(
    positions: torch.Tensor,  # [T]
    query_seq: torch.Tensor,  # [T] sequence index of each token, -1 for padding
    context_seq: torch.Tensor | None,  # [C] sequence index of each context slot, -2 for padding
) -> torch.Tensor:
    same = query_seq[None, :] == query_seq[:, None]
    causal = positions[None, :] <= positions[:, None]
    new_part = same & causal
    if context_seq is None:
        return new_part
    ctx_part = context_seq[None, :] == query_seq[:, None]
    return torch.cat([ctx_part, new_part], dim=1)


def context_positions(context_seq: torch.Tensor) -> torch.Tensor:
    """[C] position of each context slot within its sequence: each sequence's context is laid out
    contiguously from position 0 (input_builder), so it is the distance to the start of its run."""
    idx = torch.arange(context_seq.shape[0], device=context_seq.device)
    starts = torch.ones_like(context_seq, dtype=torch.bool)
    starts[1:] = context_seq[1:] != context_seq[:-1]
    return idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=0).values


def decode_mask(seq_lens: torch.Tensor, context_len: int) -> torch.Tensor:
    """[B, 1, 1, C]: key j is visible to sequence b iff j < seq_lens[b] (which counts the new token)."""
    idx = torch.arange(context_len, device=seq_lens.device)
    return (idx[None, :] < seq_lens[:, None])[:, None, None, :]


def verify_mask(positions: torch.Tensor, context_len: int) -> torch.Tensor:
    """[B, 1, S, C] for S query rows per sequence (speculative verification, positions [B, S]): key j is
    visible to a row iff j <= its position."""
    idx = torch.arange(context_len, device=positions.device)
    return (idx[None, None, :] <= positions[:, :, None])[:, None]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes the new K/V at `slots`; returns them as the cache holds them (in k's dtype): an FP8 cache
    stores K / k_scale and V / v_scale, so readers of the new tokens see what later steps will."""
    if not kv_quant.is_fp8(k_cache.dtype):
        k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
        return k, v
    kq, vq = kv_quant.quantize(k, k_scale, k_cache.dtype), kv_quant.quantize(v, v_scale, v_cache.dtype)
    # index_copy_ has no FP8 kernel on CPU: copy the bytes.
    k_cache.view(torch.uint8).index_copy_(0, slots, kq.view(torch.uint8))
    v_cache.view(torch.uint8).index_copy_(0, slots, vq.view(torch.uint8))
    return kv_quant.dequantize(kq, k_scale, k.dtype), kv_quant.dequantize(vq, v_scale, v.dtype)


def _read(cache: torch.Tensor, index, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows at `index` in the compute dtype (dequantized from FP8)."""
    if kv_quant.is_fp8(cache.dtype):
        return kv_quant.dequantize(cache[index], scale, dtype)
    return cache[index].to(dtype)


def paged_attention(
    q: torch.Tensor,  # [N, H, D]
    k: torch.Tensor,  # [N, kv, D]
    v: torch.Tensor,  # [N, kv, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,  # [H]
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Returns [N, H * D]. `k_scale` / `v_scale` (0-d float32): the per-tensor scales of an FP8 cache."""
    k, v = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, k_scale, v_scale)
    if meta.paged_decode and (sinks is not None or sliding_window is not None):
        raise ValueError("attention sinks and sliding windows need the CPU kernel or the torch attention path "
                         "(ModelSpec)")
    if meta.use_kernels:
        if kv_quant.is_fp8(k_cache.dtype):
            out = ops.paged_attention_fp8(q, k_cache, v_cache, meta.block_tables, meta.query_start,
                                          meta.positions, scale, meta.block_size, k_scale, v_scale, sinks,
                                          sliding_window)
        else:
            out = ops.paged_attention(q.to(k_cache.dtype), k_cache, v_cache, meta.block_tables,
                                      meta.query_start, meta.positions, scale, meta.block_size, sinks,
                                      sliding_window)
        return out.to(q.dtype).reshape(q.shape[0], -1)
    if meta.paged_decode:
        out = paged_decode(q.to(k_cache.dtype), k_cache, v_cache, meta.block_tables, meta.positions + 1, scale,
                           meta.block_size)
        return out.to(q.dtype).reshape(q.shape[0], -1)
    if meta.is_decode:
        return _decode(q, k_cache, v_cache, meta, scale, sinks, sliding_window, k_scale, v_scale)
    return _prefill(q, k, v, k_cache, v_cache, meta, scale, sinks, sliding_window, k_scale, v_scale)


def _attend(q, k, v, mask, scale: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA, or with sinks: softmax over [scores, sink] with the sink column dropped afterwards.
    q [..., M, D], k/v [..., L, D], mask broadcastable to [..., M, L], sinks to [..., M, 1]."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _prefill(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, sinks=None,
             sliding_window: int | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    t, h, d = q.shape
    kv = k.shape[1]
    if meta.context_slots is not None and 0 < meta.kv_segment < meta.context_slots.shape[0]:
        return _prefill_segmented(q, k, v, k_cache, v_cache, meta, scale, sinks, sliding_window, k_scale, v_scale)
    key_pos = meta.positions
    if meta.context_slots is not None:
        k = torch.cat([_read(k_cache, meta.context_slots, k_scale, q.dtype), k], dim=0)
        v = torch.cat([_read(v_cache, meta.context_slots, v_scale, q.dtype), v], dim=0)
        if sliding_window is not None:
            key_pos = torch.cat([meta.context_positions, meta.positions])
    g = h // kv
    # Fold the g query heads sharing a KV head into the query-length axis: [kv, g * T, D].
    qf = q.view(t, kv, g, d).permute(1, 2, 0, 3).reshape(kv, g * t, d)
    mask = meta.mask
    if sliding_window is not None:
        mask = mask & (meta.positions[:, None] - key_pos[None, :] < sliding_window)
    mask = mask.repeat(g, 1)  # rows ordered (group, token) like qf
    if sinks is not None:
        sinks = sinks.view(kv, g, 1, 1).expand(kv, g, t, 1).reshape(kv, g * t, 1)
    out = _attend(qf, k.transpose(0, 1), v.transpose(0, 1), mask, scale, sinks)  # [kv, g * T, D]
    return out.view(kv, g, t, d).permute(2, 0, 1, 3).reshape(t, h * d)


def _prefill_segmented(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, sinks, sliding_window,
                       k_scale, v_scale) -> torch.Tensor:
    """Prefill attention reading the context `meta.kv_segment` slots at a time (kv_segment_size_buckets),
    then the new tokens, merged with a running max and sum (online softmax, in float32): the scores held
    at once are [kv, g * T, segment] instead of [kv, g * T, C + T]. Same result as `_prefill`."""
    t, h, d = q.shape
    kv = k.shape[1]
    g = h // kv
    qf = q.view(t, kv, g, d).permute(1, 2, 0, 3).reshape(kv, g * t, d)
    c = meta.context_slots.shape[0]
    if sinks is None:
        m = torch.full((kv, g * t, 1), float("-inf"), device=q.device)
        norm = torch.zeros((kv, g * t, 1), device=q.device)
    else:  # the sink starts the running softmax: it normalizes, and adds nothing to the values
        m = sinks.float().view(kv, g, 1, 1).expand(kv, g, t, 1).reshape(kv, g * t, 1)
        norm = torch.ones((kv, g * t, 1), device=q.device)
    acc = torch.zeros((kv, g * t, d), device=q.device)

    def add(keys, values, mask, key_pos):
        nonlocal m, norm, acc
        if sliding_window is not None:
            mask = mask & (meta.positions[:, None] - key_pos[None, :] < sliding_window)
        scores = torch.matmul(qf, keys.transpose(0, 1).transpose(-1, -2)).float() * scale
        scores = scores.masked_fill(~mask.repeat(g, 1), float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # rows with no key yet
        p = torch.exp(scores - shift)
        keep = torch.exp(m - shift)
        norm = norm * keep + p.sum(dim=-1, keepdim=True)
        acc = acc * keep + torch.matmul(p, values.transpose(0, 1).float())
        m = m_new

    for start in range(0, c, meta.kv_segment):
        end = min(start + meta.kv_segment, c)
        slots = meta.context_slots[start:end]
        add(_read(k_cache, slots, k_scale, q.dtype), _read(v_cache, slots, v_scale, q.dtype),
            meta.mask[:, start:end], meta.context_positions[start:end] if sliding_window is not None else None)
    add(k, v, meta.mask[:, c:], meta.positions)
    out = (acc / norm).to(q.dtype)
    return out.view(kv, g, t, d).permute(2, 0, 1, 3).reshape(t, h * d)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, sinks=None,
            sliding_window: int | None = None, k_scale=None, v_scale=None) -> torch.Tensor:
    """S = N / B query rows per sequence: 1 for decode, 1 + K for speculative verification (then the mask
    is `verify_mask`'s [B, 1, S, C]); a sequence's rows and head groups share one query axis."""
    n, h, d = q.shape
    kv = k_cache.shape[1]
    tables = meta.block_tables
    b, nblk = tables.shape
    s, g = n // b, h // kv
    block_size = meta.mask.shape[-1] // nblk
    kc = _read(k_cache.view(-1, block_size, kv, d), tables, k_scale, q.dtype)
    vc = _read(v_cache.view(-1, block_size, kv, d), tables, v_scale, q.dtype)
    kc = kc.view(b, nblk * block_size, kv, d).transpose(1, 2)
    vc = vc.view(b, nblk * block_size, kv, d).transpose(1, 2)
    qf = q.view(b, s, kv, g, d).transpose(1, 2).reshape(b, kv, s * g, d)
    mask = meta.mask
    if sliding_window is not None:
        idx = torch.arange(mask.shape[-1], device=mask.device)
        mask = mask & (idx[None, :] > meta.positions[:, None] - sliding_window).view(b, 1, s, -1)
    mask = mask if s == 1 else mask.repeat_interleave(g, dim=2)  # rows ordered (row, group)
    if sinks is not None:
        sinks = sinks.view(1, kv, 1, g).expand(1, kv, s, g).reshape(1, kv, s * g, 1)
    out = _attend(qf, kc.to(q.dtype), vc.to(q.dtype), mask, scale, sinks)
    return out.view(b, kv, s, g, d).transpose(1, 2).reshape(n, h * d)
