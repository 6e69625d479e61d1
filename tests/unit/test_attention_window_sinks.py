"""Torch-path paged attention with a sliding window and attention sinks vs a per-query reference, for a
prefill segment that reads cached context (two sequences) and for decode."""
from __future__ import annotations

import torch

from vllm_neuron.model.layers.attention import (AttentionMetadata, context_positions, decode_mask, paged_attention,
                                                prefill_mask, verify_mask)

H, KV, D, BS, WINDOW = 4, 2, 8, 4, 5


def _reference(q, keys, values, qpos, kpos, sinks, scale):
    """One query row [H, D] over its sequence's keys [L, KV, D] at positions kpos."""
    out = []
    for h in range(H):
        kh = h // (H // KV)
        visible = (kpos <= qpos) & (qpos - kpos < WINDOW)
        s = (keys[visible, kh] @ q[h]) * scale
        p = torch.softmax(torch.cat([s, sinks[h:h + 1]]), 0)[:-1]
        out.append(p @ values[visible, kh])
    return torch.cat(out)


def test_context_positions_restart_per_sequence():
    assert context_positions(torch.tensor([0, 0, 0, 1, 1, -2, -2])).tolist() == [0, 1, 2, 0, 1, 0, 1]


def test_prefill_with_context_and_decode_match_reference():
    g = torch.Generator().manual_seed(0)
    sinks, scale = torch.randn(H, generator=g), D**-0.5
    kc, vc = torch.zeros(64, KV, D), torch.zeros(64, KV, D)
    # Sequence 0: 7 cached tokens in blocks [2, 3], 3 new; sequence 1: no context, 4 new (blocks [5]).
    lens_ctx, lens_new, blocks = [7, 0], [3, 4], [[2, 3, 4], [5]]
    ctx_k = torch.randn(7, KV, D, generator=g)
    ctx_v = torch.randn(7, KV, D, generator=g)
    ctx_slots = torch.tensor([blocks[0][p // BS] * BS + p % BS for p in range(7)])
    kc[ctx_slots], vc[ctx_slots] = ctx_k, ctx_v
    pos = torch.tensor([7, 8, 9, 0, 1, 2, 3])
    seq = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    slots = torch.tensor([blocks[s][p // BS] * BS + p % BS for s, p in zip(seq.tolist(), pos.tolist())])
    q, k, v = (torch.randn(7, n, D, generator=g) for n in (H, KV, KV))
    ctx_seq = torch.zeros(7, dtype=torch.long)
    meta = AttentionMetadata(slots, prefill_mask(pos, seq, ctx_seq), context_slots=ctx_slots, positions=pos,
                             context_positions=context_positions(ctx_seq))
    out = paged_attention(q, k, v, kc, vc, meta, scale, sinks, WINDOW).view(7, H, D)
    for i in range(7):
        s = int(seq[i])
        rows = seq == s
        keys = torch.cat([ctx_k, k[rows]]) if s == 0 else k[rows]
        vals = torch.cat([ctx_v, v[rows]]) if s == 0 else v[rows]
        kpos = torch.cat([torch.arange(7), pos[rows]]) if s == 0 else pos[rows]
        torch.testing.assert_close(out[i].reshape(-1), _reference(q[i], keys, vals, pos[i], kpos, sinks, scale))
    # Decode: sequence 0's next token at position 10 (block 4), context bucket of 3 blocks.
    qd, kd, vd = (torch.randn(1, n, D, generator=g) for n in (H, KV, KV))
    tables = torch.tensor([blocks[0]])
    dpos = torch.tensor([10])
    dmeta = AttentionMetadata(torch.tensor([4 * BS + 2]), decode_mask(dpos + 1, 3 * BS), block_tables=tables,
                              is_decode=True, positions=dpos)
    dout = paged_attention(qd, kd, vd, kc, vc, dmeta, scale, sinks, WINDOW).view(H, D)
    keys = torch.cat([ctx_k, k[:3], kd])
    vals = torch.cat([ctx_v, v[:3], vd])
    torch.testing.assert_close(dout.reshape(-1), _reference(qd[0], keys, vals, 10, torch.arange(11), sinks, scale))

    # Speculative verification: two query rows (positions 11, 12) of the same sequence in one decode call.
    qv, kv_, vv = (torch.randn(2, n, D, generator=g) for n in (H, KV, KV))
    vpos = torch.tensor([11, 12])
    vmeta = AttentionMetadata(torch.tensor([4 * BS + 3, 5 * BS]), verify_mask(vpos.view(1, 2), 4 * BS),
                              block_tables=torch.tensor([[2, 3, 4, 5]]), is_decode=True, positions=vpos)
    vout = paged_attention(qv, kv_, vv, kc, vc, vmeta, scale, sinks, WINDOW).view(2, H, D)
    keys = torch.cat([keys, kv_])
    vals = torch.cat([vals, vv])
    for r in range(2):
        torch.testing.assert_close(vout[r].reshape(-1), _reference(qv[r], keys, vals, vpos[r], torch.arange(13), sinks,
                                                                   scale))


import dataclasses  # noqa: E402

import pytest  # noqa: E402


@pytest.mark.parametrize("segment", [1, 3, 5, 15])
@pytest.mark.parametrize("sinks_window", [False, True])
def test_context_read_in_segments_equals_all_at_once(segment, sinks_window):
    """kv_segment_size: the context in segments (online softmax) gives what one pass over it gives, with
    two sequences' contexts, padding slots, uneven last segments, sinks and a window."""
    g = torch.Generator().manual_seed(1)
    kc, vc = torch.randn(64, KV, D, generator=g), torch.randn(64, KV, D, generator=g)
    ctx_seq = torch.tensor([0] * 7 + [1] * 5 + [-2] * 4)  # C = 16 slots, 4 of them padding
    ctx_slots = torch.tensor(list(range(8, 15)) + list(range(20, 25)) + [0] * 4)
    pos = torch.tensor([7, 8, 9, 5, 6, 0])  # the last row is padding (sequence -1)
    seq = torch.tensor([0, 0, 0, 1, 1, -1])
    slots = torch.tensor([15, 16, 17, 25, 26, 63])
    q, k, v = (torch.randn(6, n, D, generator=g) for n in (H, KV, KV))
    sinks, window = (torch.randn(H, generator=g), WINDOW) if sinks_window else (None, None)
    meta = AttentionMetadata(slots, prefill_mask(pos, seq, ctx_seq), context_slots=ctx_slots, positions=pos,
                             context_positions=context_positions(ctx_seq))
    whole = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, D**-0.5, sinks, window)
    parts = paged_attention(q, k, v, kc.clone(), vc.clone(), dataclasses.replace(meta, kv_segment=segment),
                            D**-0.5, sinks, window)
    assert torch.isfinite(parts).all()
    torch.testing.assert_close(parts[:5], whole[:5], rtol=1e-5, atol=1e-5)
