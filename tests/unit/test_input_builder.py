"""Padded step inputs (worker/input_builder.py) and the attention masks / paged attention they feed."""
import pytest
import torch

from vllm_neuron.model.layers.attention import AttentionMetadata, decode_mask, paged_attention, prefill_mask
from vllm_neuron.model.layers.kernels.cpu_caps import kernels_enabled
from vllm_neuron.step import ScheduledChunk
from vllm_neuron.worker.input_builder import build_decode_inputs, build_prefill_inputs, token_slots

BS = 4


def chunk(rid, start, n, blocks, first_tok=0):
    return ScheduledChunk(rid, list(range(first_tok, first_tok + n)), start, blocks, sample=True)


def test_token_slots():
    # slot = block * block_size + offset, across a block boundary.
    assert token_slots([3, 7], 2, 6, BS).tolist() == [14, 15, 28, 29]


# -- prefill -----------------------------------------------------------------------------------------

def test_prefill_without_context():
    chunks = [chunk("a", 0, 5, [3, 7], 10), chunk("b", 0, 2, [2], 20)]
    x = build_prefill_inputs(chunks, num_tokens=8, num_context=0, num_rows=4, block_size=BS)
    assert x.input_ids.tolist() == [10, 11, 12, 13, 14, 20, 21, 0]
    assert x.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 0]
    # Padding writes into the null block.
    assert x.slot_mapping.tolist() == [12, 13, 14, 15, 28, 8, 9, 0]
    assert x.query_seq.tolist() == [0, 0, 0, 0, 0, 1, 1, -1]
    assert x.context_slots is None and x.context_seq is None
    assert x.logits_indices.tolist()[:2] == [4, 6]
    assert len(x.logits_indices) == 4


def test_prefill_with_context_and_padding():
    # "a": fresh 3 tokens; "b": tokens 6..8 after 6 cached (positions 0..5 in blocks 2 and 5).
    chunks = [chunk("a", 0, 3, [4], 30), chunk("b", 6, 3, [2, 5, 9], 40)]
    x = build_prefill_inputs(chunks, num_tokens=8, num_context=8, num_rows=2, block_size=BS)
    assert x.input_ids.tolist() == [30, 31, 32, 40, 41, 42, 0, 0]
    assert x.positions.tolist() == [0, 1, 2, 6, 7, 8, 0, 0]
    assert x.slot_mapping.tolist() == [16, 17, 18, 22, 23, 36, 0, 0]
    assert x.query_seq.tolist() == [0, 0, 0, 1, 1, 1, -1, -1]
    assert x.context_slots.tolist() == [8, 9, 10, 11, 20, 21, 0, 0]
    assert x.context_seq.tolist() == [1, 1, 1, 1, 1, 1, -2, -2]
    assert x.logits_indices.tolist() == [2, 5]


def test_prefill_contexts_of_several_chunks_are_concatenated():
    chunks = [chunk("a", 2, 1, [6]), chunk("b", 4, 2, [1, 3])]
    x = build_prefill_inputs(chunks, num_tokens=4, num_context=8, num_rows=2, block_size=BS)
    assert x.context_slots.tolist()[:6] == [24, 25, 4, 5, 6, 7]
    assert x.context_seq.tolist() == [0, 0, 1, 1, 1, 1, -2, -2]
    assert x.slot_mapping.tolist() == [26, 12, 13, 0]


# -- decode ------------------------------------------------------------------------------------------

def test_decode_inputs_and_padded_rows():
    chunks = [chunk("a", 5, 1, [4, 6], 50), chunk("b", 2, 1, [7], 60), chunk("c", 7, 1, [1, 2], 70)]
    x = build_decode_inputs(chunks, batch=4, context=8, block_size=BS)
    assert x.input_ids.tolist() == [50, 60, 70, 0]
    assert x.positions.tolist() == [5, 2, 7, 0]
    assert x.slot_mapping.tolist() == [25, 30, 11, 0]
    assert x.block_tables.tolist() == [[4, 6], [7, 0], [1, 2], [0, 0]]
    assert x.seq_lens.tolist() == [6, 3, 8, 1]


def test_decode_table_truncated_to_context_bucket():
    # A table longer than the bucket needs only its blocks up to the new token.
    x = build_decode_inputs([chunk("a", 3, 1, [5, 8, 9, 11])], batch=1, context=8, block_size=BS)
    assert x.block_tables.tolist() == [[5, 0]]
    assert x.seq_lens.tolist() == [4]
    x = build_decode_inputs([chunk("a", 4, 1, [5, 8, 9, 11])], batch=2, context=8, block_size=BS)
    assert x.block_tables.tolist() == [[5, 8], [0, 0]]
    assert x.slot_mapping.tolist() == [32, 0]


# -- masks ---------------------------------------------------------------------------------------------

def _prefill_case():
    chunks = [chunk("a", 0, 3, [4]), chunk("b", 6, 3, [2, 5, 9]), chunk("c", 1, 2, [7])]
    x = build_prefill_inputs(chunks, num_tokens=12, num_context=10, num_rows=4, block_size=BS)
    return chunks, x


def test_prefill_mask_semantics():
    chunks, x = _prefill_case()
    m = prefill_mask(torch.from_numpy(x.positions), torch.from_numpy(x.query_seq), torch.from_numpy(x.context_seq))
    c = len(x.context_seq)
    assert m.shape == (12, c + 12) and m.dtype == torch.bool
    # Every row sees at least one key (padding rows included), so softmax never yields NaN.
    assert m.any(dim=1).all()
    qs, pos, cs = x.query_seq.tolist(), x.positions.tolist(), x.context_seq.tolist()
    for i in range(12):
        for j in range(c):  # context keys: exactly those of the row's own sequence, never padding
            assert bool(m[i, j]) == (qs[i] >= 0 and cs[j] == qs[i])
        for j in range(12):  # new keys: own sequence, causal
            if qs[i] != qs[j]:
                assert not m[i, c + j]
            elif qs[i] >= 0:
                assert bool(m[i, c + j]) == (pos[j] <= pos[i])
    # Row i of sequence s sees start_pos context keys plus its own prefix in the chunk.
    counts = m.sum(dim=1).tolist()
    assert counts[:8] == [1, 2, 3, 7, 8, 9, 2, 3]
    assert all(n >= 1 for n in counts[8:])


def test_prefill_mask_without_context():
    q = torch.tensor([0, 0, 1, -1])
    p = torch.tensor([0, 1, 0, 0])
    m = prefill_mask(p, q, None)
    assert m.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [False, False, True, False],
        [False, False, False, True],
    ]


def test_decode_mask():
    m = decode_mask(torch.tensor([6, 3, 1]), 8)
    assert m.shape == (3, 1, 1, 8)
    assert m[:, 0, 0].sum(dim=1).tolist() == [6, 3, 1]
    assert m[1, 0, 0].tolist() == [True] * 3 + [False] * 5
    assert m[2, 0, 0, 0]  # padded row (seq_len 1) still sees one key


# -- paged attention against a dense reference ----------------------------------------------------------

H, KV, D = 4, 2, 8
NUM_BLOCKS = 12


def _reference(q, k_all, v_all, scale):
    """Causal attention of queries at the last len(q) positions over k_all/v_all [L, KV, D]."""
    n, length = q.shape[0], k_all.shape[0]
    k = k_all.repeat_interleave(H // KV, dim=1).transpose(0, 1)  # [H, L, D]
    v = v_all.repeat_interleave(H // KV, dim=1).transpose(0, 1)
    s = torch.einsum("nhd,hld->hnl", q, k) * scale
    qpos = torch.arange(length - n, length)[:, None]
    s = s.masked_fill(torch.arange(length)[None, :] > qpos, float("-inf"))
    return torch.einsum("hnl,hld->nhd", s.softmax(-1), v).reshape(n, H * D)


def _seq_kv(g, length):
    return torch.randn(length, KV, D, generator=g), torch.randn(length, KV, D, generator=g)


def _cache(g):
    # Junk everywhere: only slots the masks allow may influence the result.
    return (torch.randn(NUM_BLOCKS * BS, KV, D, generator=g) * 50,
            torch.randn(NUM_BLOCKS * BS, KV, D, generator=g) * 50)


def _kernels_on() -> None:
    assert kernels_enabled(torch.device("cpu")), "the custom CPU kernels failed to build (see the log)"


@pytest.mark.parametrize("kernels", [False, True])
def test_paged_prefill_matches_dense_attention(kernels):
    g = torch.Generator().manual_seed(0)
    chunks, x = _prefill_case()
    kc, vc = _cache(g)
    t = len(x.positions)
    q = torch.randn(t, H, D, generator=g)
    k = torch.randn(t, KV, D, generator=g)
    v = torch.randn(t, KV, D, generator=g)
    full = {}
    row = 0
    for ch in chunks:
        end = ch.start_pos + len(ch.token_ids)
        ka, va = _seq_kv(g, end)
        ctx = torch.from_numpy(token_slots(ch.block_ids, 0, ch.start_pos, BS))
        kc[ctx], vc[ctx] = ka[:ch.start_pos], va[:ch.start_pos]
        k[row:row + len(ch.token_ids)] = ka[ch.start_pos:]
        v[row:row + len(ch.token_ids)] = va[ch.start_pos:]
        full[ch.req_id] = (row, end, ka, va)
        row += len(ch.token_ids)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(x.slot_mapping),
        mask=prefill_mask(torch.from_numpy(x.positions), torch.from_numpy(x.query_seq),
                          torch.from_numpy(x.context_seq)),
        context_slots=torch.from_numpy(x.context_slots))
    if kernels:
        _kernels_on()
        xk = build_prefill_inputs(chunks, num_tokens=12, num_context=0, num_rows=4, block_size=BS, max_blocks=4)
        assert xk.context_slots is None and xk.query_start.tolist() == [0, 3, 6, 8, 8]
        meta = AttentionMetadata(torch.from_numpy(xk.slot_mapping), block_tables=torch.from_numpy(xk.seq_tables),
                                 query_start=torch.from_numpy(xk.query_start), positions=torch.from_numpy(xk.positions),
                                 block_size=BS, use_kernels=True)
    out = paged_attention(q, k, v, kc, vc, meta, D ** -0.5)
    assert out.shape == (t, H * D) and torch.isfinite(out).all()
    for ch in chunks:
        r, end, ka, va = full[ch.req_id]
        n = len(ch.token_ids)
        torch.testing.assert_close(out[r:r + n], _reference(q[r:r + n], ka, va, D ** -0.5), atol=1e-5, rtol=1e-5)
        # The new K/V landed in the request's slots.
        slots = torch.from_numpy(token_slots(ch.block_ids, ch.start_pos, end, BS))
        assert torch.equal(kc[slots], ka[ch.start_pos:])


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("context", [8, 16])
def test_paged_decode_matches_dense_attention(context, kernels):
    g = torch.Generator().manual_seed(1)
    chunks = [chunk("a", 5, 1, [4, 6]), chunk("b", 2, 1, [7]), chunk("c", 7, 1, [1, 2])]
    x = build_decode_inputs(chunks, batch=4, context=context, block_size=BS)
    kc, vc = _cache(g)
    q = torch.randn(4, H, D, generator=g)
    k = torch.randn(4, KV, D, generator=g)
    v = torch.randn(4, KV, D, generator=g)
    full = []
    for i, ch in enumerate(chunks):
        ka, va = _seq_kv(g, ch.start_pos + 1)
        ctx = torch.from_numpy(token_slots(ch.block_ids, 0, ch.start_pos, BS))
        kc[ctx], vc[ctx] = ka[:-1], va[:-1]
        k[i], v[i] = ka[-1], va[-1]
        full.append((ka, va))
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(x.slot_mapping),
        mask=decode_mask(torch.from_numpy(x.seq_lens), context),
        block_tables=torch.from_numpy(x.block_tables), is_decode=True)
    if kernels:
        _kernels_on()
        meta = AttentionMetadata(torch.from_numpy(x.slot_mapping), block_tables=torch.from_numpy(x.block_tables),
                                 query_start=torch.arange(5), positions=torch.from_numpy(x.positions),
                                 block_size=BS, is_decode=True, use_kernels=True)
    out = paged_attention(q, k, v, kc, vc, meta, D ** -0.5)
    assert out.shape == (4, H * D) and torch.isfinite(out).all()
    for i, (ka, va) in enumerate(full):
        torch.testing.assert_close(out[i:i + 1], _reference(q[i:i + 1], ka, va, D ** -0.5), atol=1e-5, rtol=1e-5)
