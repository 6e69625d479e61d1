"""The custom CPU kernels against plain torch: paged attention (prefill with cached context, decode,
padding rows) and the bf16 small-batch linear, in fp32 and bf16."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from vllm_neuron.config import cpu_class
from vllm_neuron.model.layers.kernels import build, ops
from vllm_neuron.model.layers.kernels import cpu_caps as caps
from vllm_neuron.model.layers import linear as L
from vllm_neuron.model.layers.kernel_config import KernelConfig

CPU = torch.device("cpu")
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", autouse=True)
def built():
    assert caps.kernels_enabled(CPU), "the custom CPU kernels failed to build (see the log)"


def _reference(q, kc, vc, tables, starts, positions, scale, bs):
    n, h, d = q.shape
    kv = kc.shape[1]
    out = torch.zeros(n, h, d)
    for s in range(tables.shape[0]):
        for r in range(int(starts[s]), int(starts[s + 1])):
            p = torch.arange(int(positions[r]) + 1)
            slots = tables[s][p // bs] * bs + p % bs
            k, v = kc[slots].float().transpose(0, 1), vc[slots].float().transpose(0, 1)  # [kv, L, d]
            qr = q[r].float().view(kv, h // kv, d)
            out[r] = F.scaled_dot_product_attention(qr, k, v, scale=scale).reshape(h, d)
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_paged_attention_prefill_and_decode(dtype, tol, heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    d, bs, nblocks = 64, 16, 40
    kc = (torch.randn(nblocks * bs, kv_heads, d, generator=g) * 4).to(dtype)
    vc = torch.randn(nblocks * bs, kv_heads, d, generator=g).to(dtype)
    tables = torch.randperm(nblocks - 1, generator=g)[:30].add(1).view(3, 10)
    # Prefill: seq 0 has 70 cached tokens and 5 new rows, seq 1 is 40 new rows from 0, then 3 padding rows.
    starts = torch.tensor([0, 5, 45, 45])
    positions = torch.cat([torch.arange(70, 75), torch.arange(40), torch.zeros(3, dtype=torch.long)])
    q = torch.randn(48, heads, d, generator=g).to(dtype)
    out = ops.paged_attention(q, kc, vc, tables, starts, positions, 0.125, bs)
    ref = _reference(q, kc, vc, tables, starts, positions, 0.125, bs)
    torch.testing.assert_close(out[:45].float(), ref[:45], atol=tol, rtol=tol)
    assert torch.equal(out[45:], torch.zeros_like(out[45:]))  # padding rows
    # Decode: one row per sequence, lengths across block and tile edges.
    positions = torch.tensor([0, 31, 159])
    q = torch.randn(3, heads, d, generator=g).to(dtype)
    out = ops.paged_attention(q, kc, vc, tables, torch.arange(4), positions, 0.125, bs)
    torch.testing.assert_close(out.float(), _reference(q, kc, vc, tables, torch.arange(4), positions, 0.125, bs),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("d", [64, 72, 80, 128])
def test_paged_attention_long_prefill_in_row_blocks(dtype, tol, d):
    """Prefill long enough for several row blocks per KV head (each widening its keys once) and query-row
    blocks with a remainder; head dims in whole groups of four vectors (64, 128), with a remainder vector
    (80), and one that is no whole number of AVX-512 vectors (72: the per-row path)."""
    g = torch.Generator().manual_seed(d)
    heads, kv_heads, bs, nblocks = 9, 3, 16, 60
    kc = (torch.randn(nblocks * bs, kv_heads, d, generator=g) * 2).to(dtype)
    vc = torch.randn(nblocks * bs, kv_heads, d, generator=g).to(dtype)
    tables = (torch.randperm(nblocks - 1, generator=g)[:58] + 1).view(2, 29)
    # seq 0: 301 new rows from position 0; seq 1: 70 new rows after 200 cached tokens.
    starts = torch.tensor([0, 301, 371])
    positions = torch.cat([torch.arange(301), torch.arange(200, 270)])
    q = torch.randn(371, heads, d, generator=g).to(dtype)
    out = ops.paged_attention(q, kc, vc, tables, starts, positions, d ** -0.5, bs)
    ref = _reference(q, kc, vc, tables, starts, positions, d ** -0.5, bs)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("d", [72, 80, 128])
def test_paged_decode_attention_head_dims(dtype, tol, d):
    """Decode rows (keys and values read in place) at head dims beyond the bundled model's 64: with a
    remainder vector (80), several groups of four vectors (128), no whole AVX-512 vector (72: copying path)."""
    g = torch.Generator().manual_seed(d)
    heads, kv_heads, bs, nblocks = 12, 3, 16, 30
    kc = (torch.randn(nblocks * bs, kv_heads, d, generator=g) * 2).to(dtype)
    vc = torch.randn(nblocks * bs, kv_heads, d, generator=g).to(dtype)
    tables = (torch.randperm(nblocks - 1, generator=g)[:28] + 1).view(4, 7)
    positions = torch.tensor([0, 5, 16, 7 * bs - 1])
    q = torch.randn(4, heads, d, generator=g).to(dtype)
    starts = torch.arange(5)
    out = ops.paged_attention(q, kc, vc, tables, starts, positions, d ** -0.5, bs)
    torch.testing.assert_close(out.float(), _reference(q, kc, vc, tables, starts, positions, d ** -0.5, bs),
                               atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_paged_decode_attention_gqa_at_every_decode_bucket(dtype, tol, batch):
    """Decode rows of the bundled model's head layout (9 query heads on 3 KV heads, one pass over each KV
    head's blocks for its group) at odd lengths, block edges and a full block table."""
    g = torch.Generator().manual_seed(batch)
    heads, kv_heads, d, bs, per_seq = 9, 3, 64, 32, 6
    nblocks = batch * per_seq + 1
    kc = (torch.randn(nblocks * bs, kv_heads, d, generator=g) * 4).to(dtype)
    vc = torch.randn(nblocks * bs, kv_heads, d, generator=g).to(dtype)
    tables = (torch.randperm(nblocks - 1, generator=g) + 1).view(batch, per_seq)
    edges = [0, 1, bs - 1, bs, bs + 1, 3 * bs + 7, per_seq * bs - 1]  # the last: every slot of the table
    positions = torch.tensor([edges[i % len(edges)] if i < len(edges) else
                              int(torch.randint(per_seq * bs, (1,), generator=g)) for i in range(batch)])
    q = torch.randn(batch, heads, d, generator=g).to(dtype)
    starts = torch.arange(batch + 1)
    out = ops.paged_attention(q, kc, vc, tables, starts, positions, 0.125, bs)
    ref = _reference(q, kc, vc, tables, starts, positions, 0.125, bs)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)



@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float8_e4m3fn, 1e-5)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_decode_rows_split_along_their_keys_match_reference(dtype, tol, with_sinks):
    """With fewer decode rows than two per thread, each row's keys are split into stretches merged afterwards
    (stretches of whole slots for fp32 and bf16 caches, one per KV head for FP8): one row over 700 keys, and
    two rows over 501 and 2 keys (the short row's later stretches are empty)."""
    g = torch.Generator().manual_seed(7 + with_sinks)
    heads, kv_heads, d, bs, per_seq = 9, 3, 64, 32, 24
    nblocks = 2 * per_seq + 1
    cache_dtype = dtype
    dtype = torch.float32 if dtype == torch.float8_e4m3fn else dtype
    kc = (torch.randn(nblocks * bs, kv_heads, d, generator=g) * 3).to(cache_dtype)
    vc = torch.randn(nblocks * bs, kv_heads, d, generator=g).to(cache_dtype)
    tables = (torch.randperm(nblocks - 1, generator=g) + 1).view(2, per_seq)
    sinks = torch.randn(heads, generator=g) * 2 if with_sinks else None
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for positions in ([699], [500, 1]):
            n = len(positions)
            q = torch.randn(n, heads, d, generator=g).to(dtype)
            starts, pos = torch.arange(n + 1), torch.tensor(positions)
            if cache_dtype == torch.float8_e4m3fn:
                one = torch.tensor(1.0)
                out = ops.paged_attention_fp8(q, kc, vc, tables[:n], starts, pos, 0.125, bs, one, one, sinks)
            else:
                out = ops.paged_attention(q, kc, vc, tables[:n], starts, pos, 0.125, bs, sinks)
            ref = _reference_sinks_window(q, kc, vc, tables[:n], starts, pos, 0.125, bs, sinks, 0)
            torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(threads)

@pytest.mark.parametrize("d", [64, 128])
def test_bf16_prefill_over_a_long_cached_context(d):
    """The shape of a prompt after a cached prefix (32 new rows over 1,024 cached tokens, and 3 such sequences
    in one step), bf16: on AMX CPUs these items run on tiles, on other AVX512-BF16 CPUs by bf16 dot products in
    vector registers, both with the probabilities rounded to bf16, and the result stays within bf16's error of
    fp32 attention across 33 blocks of online softmax."""
    assert caps.attention_on_tiles(d) == caps.tile_kernel_built()  # both need the AMX build and the OS's tile state
    variant = caps.kernel_variant()[0]
    expected = "AMX tiles" if caps.tile_kernel_built() else "bf16 dot products" if variant == "avx512bf16" else "fp32 vectors"
    assert caps.attention_rows_path(d) == expected
    assert caps.attention_rows_path(80) == "fp32 vectors"  # head dims in whole blocks of 32 only
    g = torch.Generator().manual_seed(d)
    heads, kv_heads, bs, ctx, new = 9, 3, 16, 1024, 32
    per = (ctx + new) // bs + 1
    nblocks = 3 * per + 1
    kc = (torch.randn(nblocks * bs, kv_heads, d, generator=g) * 3).bfloat16()
    vc = torch.randn(nblocks * bs, kv_heads, d, generator=g).bfloat16()
    tables = (torch.randperm(nblocks - 1, generator=g) + 1).view(3, per)
    for seqs in (1, 3):
        starts = torch.arange(seqs + 1) * new
        positions = torch.cat([torch.arange(ctx - 7 * s, ctx - 7 * s + new) for s in range(seqs)])
        q = torch.randn(seqs * new, heads, d, generator=g).bfloat16()
        out = ops.paged_attention(q, kc, vc, tables[:seqs], starts, positions, d ** -0.5, bs)
        ref = _reference(q, kc, vc, tables[:seqs], starts, positions, d ** -0.5, bs)
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def _reference_sinks_window(q, kc, vc, tables, starts, positions, scale, bs, sinks, window):
    """Per row: softmax over [its window's scores, its head's sink] with the sink dropped, against V."""
    n, h, d = q.shape
    kv = kc.shape[1]
    out = torch.zeros(n, h, d)
    for s in range(tables.shape[0]):
        for r in range(int(starts[s]), int(starts[s + 1])):
            pos = int(positions[r])
            p = torch.arange(max(0, pos - window + 1) if window else 0, pos + 1)
            slots = tables[s][p // bs] * bs + p % bs
            k, v = kc[slots].float().transpose(0, 1), vc[slots].float().transpose(0, 1)  # [kv, L, d]
            qr = q[r].float().view(kv, h // kv, d)
            scores = qr @ k.transpose(1, 2) * scale  # [kv, g, L]
            if sinks is not None:
                scores = torch.cat([scores, sinks.float().view(kv, h // kv, 1)], dim=-1)
            probs = torch.softmax(scores, -1)[..., :len(p)]
            out[r] = (probs @ v).reshape(h, d)
    return out


def _null_out_of_window(tables, starts, positions, window, bs):
    """The tables a sliding-window KV group would hold: null (0) for blocks every row's window has left."""
    tables = tables.clone()
    for s in range(tables.shape[0]):
        rows = positions[int(starts[s]):int(starts[s + 1])]
        if window and len(rows):
            tables[s, :max(0, int(rows.min()) - window + 1) // bs] = 0
    return tables


@pytest.mark.parametrize("window", [0, 300])
def test_bf16_prefill_over_a_long_context_in_key_stretches(window):
    """bf16 prefill of many rows over a long cached context: the sequence's keys packed once per KV head and
    shared by its row blocks, each row block visiting the keys a stretch of 256 at a time with its softmax
    carried between stretches (and, with a sliding window, rows whose windows start in different stretches).
    The null block holds NaN: a key read outside a window fails the test."""
    g = torch.Generator().manual_seed(window)
    heads, kv_heads, d, bs, ctx, new = 9, 3, 64, 32, 900, 150
    nblocks = (ctx + new) // bs + 2
    kc = (torch.randn(nblocks * bs, kv_heads, d, generator=g) * 3).bfloat16()
    vc = torch.randn(nblocks * bs, kv_heads, d, generator=g).bfloat16()
    kc[:bs] = float("nan")
    vc[:bs] = float("nan")
    tables = (torch.randperm(nblocks - 1, generator=g) + 1).view(1, nblocks - 1)
    starts = torch.tensor([0, new])
    positions = torch.arange(ctx, ctx + new)
    tables = _null_out_of_window(tables, starts, positions, window, bs)
    q = torch.randn(new, heads, d, generator=g).bfloat16()
    out = ops.paged_attention(q, kc, vc, tables, starts, positions, d ** -0.5, bs, None, window)
    ref = _reference_sinks_window(q, kc, vc, tables, starts, positions, d ** -0.5, bs, None, window)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float8_e4m3fn, 1e-5)])
@pytest.mark.parametrize("window, with_sinks", [(0, True), (1, False), (23, True), (40, True), (200, False)])
def test_paged_attention_sinks_and_window(dtype, tol, window, with_sinks):
    # Windows of one key, odd sizes across block (16) and tile (32) edges, and one longer than every sequence.
    g = torch.Generator().manual_seed(window + with_sinks)
    heads, kv_heads, d, bs, nblocks = 8, 2, 32, 16, 40
    cache_dtype = dtype
    dtype = torch.float32 if dtype == torch.float8_e4m3fn else dtype
    kc = (torch.randn(nblocks * bs, kv_heads, d, generator=g) * 2).to(cache_dtype)
    vc = torch.randn(nblocks * bs, kv_heads, d, generator=g).to(cache_dtype)
    # Block 0 (the null block) holds NaN: a kernel that reads a key outside the window fails the test.
    kc[:bs] = float("nan")
    vc[:bs] = float("nan")
    sinks = torch.randn(heads, generator=g) * 2 if with_sinks else None
    tables = torch.randperm(nblocks - 1, generator=g)[:30].add(1).view(3, 10)

    def run(q, tables, starts, positions):
        if cache_dtype == torch.float8_e4m3fn:
            one = torch.tensor(1.0)
            return ops.paged_attention_fp8(q, kc, vc, tables, starts, positions, 0.125, bs, one, one, sinks, window)
        return ops.paged_attention(q, kc, vc, tables, starts, positions, 0.125, bs, sinks, window)

    # Prefill: seq 0 has 70 cached tokens and 5 new rows, seq 1 is 40 new rows from 0, then 3 padding rows.
    starts = torch.tensor([0, 5, 45, 45])
    positions = torch.cat([torch.arange(70, 75), torch.arange(40), torch.zeros(3, dtype=torch.long)])
    t = _null_out_of_window(tables, starts, positions, window, bs)
    q = torch.randn(48, heads, d, generator=g).to(dtype)
    out = run(q, t, starts, positions)
    ref = _reference_sinks_window(q, kc, vc, t, starts, positions, 0.125, bs, sinks, window)
    torch.testing.assert_close(out[:45].float(), ref[:45], atol=tol, rtol=tol)
    assert torch.equal(out[45:], torch.zeros_like(out[45:]))  # padding rows
    # Decode: one row per sequence, at block and tile edges; 3 sequences (an item per KV head) and 8 (enough
    # for an item per sequence reading each slot's heads together, on 2-4 threads).
    for positions in (torch.tensor([0, 32, 159]), torch.tensor([0, 32, 159, 15, 16, 100, 47, 1])):
        n = len(positions)
        starts = torch.arange(n + 1)
        t = _null_out_of_window(tables.repeat(3, 1)[:n], starts, positions, window, bs)
        q = torch.randn(n, heads, d, generator=g).to(dtype)
        torch.testing.assert_close(run(q, t, starts, positions).float(),
                                   _reference_sinks_window(q, kc, vc, t, starts, positions, 0.125, bs, sinks, window),
                                   atol=tol, rtol=tol)


def test_paged_attention_refuses_bad_sinks_and_window():
    with pytest.raises(RuntimeError, match="one logit per query head"):
        ops.paged_attention(**_attention_inputs(), sinks=torch.zeros(3))
    with pytest.raises(RuntimeError, match="window must be >= 0"):
        ops.paged_attention(**_attention_inputs(), window=-1)


def _attention_inputs():
    d, bs, nblocks = 16, 16, 4
    kc = torch.zeros(nblocks * bs, 2, d)
    return dict(q=torch.zeros(3, 4, d), k_cache=kc, v_cache=torch.zeros_like(kc),
                block_tables=torch.tensor([[1, 2], [3, 0], [0, 0]]), query_start=torch.arange(4),
                positions=torch.tensor([5, 20, 0]), scale=0.25, block_size=bs)


@pytest.mark.parametrize("change, message", [
    (dict(positions=torch.tensor([5, 20])), "one entry per query row"),
    (dict(q=torch.zeros(3, 4, 8)), "head dim"),
    (dict(v_cache=torch.zeros(64, 2, 8)), "same shape"),
    (dict(block_tables=torch.tensor([[1, 4], [3, 0], [0, 0]])), "block ids"),
    (dict(block_tables=torch.tensor([[1, -1], [3, 0], [0, 0]])), "block ids"),
    (dict(block_size=24), "whole blocks"),
])
def test_paged_attention_checks_the_bounds_it_relies_on(change, message):
    ops.paged_attention(**_attention_inputs())  # the valid inputs run
    with pytest.raises(RuntimeError, match=message):
        ops.paged_attention(**{**_attention_inputs(), **change})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
# 1-4 rows: one weight row at a time (bands on AMX CPUs); from 5: bands of four weight rows against four-row blocks plus a rest
# (six-row blocks from 17 rows on), with the weights two bands on prefetched while a thread has them.
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 13, 16, 17, 23, 32, 64])
@pytest.mark.parametrize("n, k", [(1536, 576), (576, 1536), (190, 576), (7, 64)])
def test_linear_small_batch_matches_fp32_matmul(dtype, rows, n, k):
    if dtype not in caps.linear_kernel_dtypes(CPU):
        pytest.skip(f"no {dtype} linear kernel in the {caps.kernel_variant()[0]} build: F.linear serves")
    g = torch.Generator().manual_seed(n + rows)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    ref = x.double() @ w.double().t()
    out = ops.linear_small_batch(x, w)
    assert out.dtype == dtype and out.shape == (rows, n)
    # Products are exact in fp32 for bf16 inputs; the error is the rounding of the result (plus summation
    # order, visible only where the sum cancels to near zero).
    rtol = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), ref, atol=1e-4 * ref.abs().max().item(), rtol=rtol)


def test_linear_layer_takes_the_kernel_only_for_small_batches_of_its_dtypes(monkeypatch):
    calls = []
    monkeypatch.setattr(L, "linear_small_batch", lambda x, w: calls.append((x.shape[0], x.dtype)) or F.linear(x, w))
    layer = L.Linear(64, 32, bias=False).bfloat16()
    layer(torch.randn(2, 64).bfloat16())  # a layer built outside an engine: torch's paths only
    layer.kernels = KernelConfig(linear_dtypes=frozenset({torch.bfloat16}), linear_rows=4)
    layer(torch.randn(4, 64).bfloat16())
    layer(torch.randn(5, 64).bfloat16())  # above the limit: oneDNN
    layer.float()(torch.randn(2, 64))  # fp32 is not in the set
    layer.kernels = KernelConfig(linear_dtypes=frozenset({torch.float32}), linear_rows=16)
    layer(torch.randn(16, 64))
    layer(torch.randn(17, 64))
    layer.kernels = KernelConfig(linear_rows=16)
    layer.bfloat16()(torch.randn(1, 64).bfloat16())
    assert calls == [(4, torch.bfloat16), (16, torch.float32)]


def test_bf16_rows_above_the_kernel_run_in_fp32_where_the_cpu_has_no_bf16_matmul(monkeypatch):
    seen = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: seen.append((x.shape[0], x.dtype, w.dtype)) or linear(x, w, b))
    layer = L.Linear(64, 32, bias=True).bfloat16()
    x = torch.randn(9, 64).bfloat16()
    layer.kernels = KernelConfig(linear_dtypes=frozenset({torch.bfloat16}), linear_rows=4, widen_bf16=True)
    out = layer(x)
    assert seen == [(9, torch.float32, torch.float32)]  # weights widened, the product in fp32, rounded once
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, linear(x.float(), layer.weight.float(), layer.bias.float()).bfloat16())
    seen.clear()
    layer.kernels = KernelConfig(linear_dtypes=frozenset({torch.bfloat16}), linear_rows=4)  # bf16 matmul hardware
    layer(x)
    assert seen == [(9, torch.bfloat16, torch.bfloat16)]
    from vllm_neuron.model.layers.kernel_config import resolve_kernel_config
    # This process's build: the forced avx2 run of this file (test_forced_avx2_build_passes_the_same_checks) widens.
    assert resolve_kernel_config(CPU, torch.bfloat16).widen_bf16 == (caps.kernel_variant()[0] == "avx2")
    assert not resolve_kernel_config(CPU, torch.float32).widen_bf16


def test_widening_bf16_pays_in_the_avx2_class_only():
    assert caps.widen_pays(CPU, torch.bfloat16, "avx2")
    assert not caps.widen_pays(CPU, torch.bfloat16, "avx512bf16")  # VDPBF16PS / AMX tiles multiply bf16 in hardware
    assert not caps.widen_pays(CPU, torch.bfloat16, "generic")  # no decode kernel: every row would widen
    assert not caps.widen_pays(CPU, torch.float32, "avx2")
    assert not caps.widen_pays(torch.device("cuda"), torch.bfloat16, "avx2")


def test_small_batch_rows_per_cpu_class():
    # bf16 from 5 rows on: a tile kernel on packed weights (AMX tiles, or VDPBF16PS dot products without AMX)
    assert caps.small_batch_rows("avx512bf16", torch.bfloat16) == 4
    assert caps.small_batch_rows("avx512bf16", torch.float32) == 64  # no fp32 tiles; oneDNN 2x slower at 64 rows
    assert caps.small_batch_rows("avx2", torch.float32) == 64  # oneDNN 1.3-3x slower to 64 rows
    assert caps.small_batch_rows("avx2", torch.bfloat16) == 64  # oneDNN emulates bf16 there
    assert caps.small_batch_rows("generic", torch.float32) == 4  # no linear kernel in that build


def test_quant_kernel_rows_reach_64_only_where_bf16_bands_run_on_vdpbf16ps(monkeypatch):
    bf16_bands = caps.has_op("linear_dot_tiles")  # the avx512bf16 build: int8 / int4 bands dequantized into L1
    assert caps.quant_kernel_rows(CPU, torch.bfloat16) == (64 if bf16_bands else 16)
    assert caps.quant_kernel_rows(CPU, torch.float32) == 16
    monkeypatch.setattr(caps, "quant_kernels_available", lambda device: False)
    assert caps.quant_kernel_rows(CPU, torch.bfloat16) == 0
    from vllm_neuron.model.layers.kernel_config import resolve_kernel_config
    assert resolve_kernel_config(CPU, torch.bfloat16).quant_rows == 0


def _silu_reference(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.double().chunk(2, dim=-1)
    return F.silu(gate) * up


# Row counts below and above the split between threads (16,384 elements a thread at least), odd widths.
@pytest.mark.parametrize("rows", [1, 7, 16, 32, 33, 128, 513])
@pytest.mark.parametrize("inter", [1536, 576, 7])
def test_silu_and_mul_is_rounded_once_from_fp32(rows, inter):
    g = torch.Generator().manual_seed(rows * 1000 + inter)
    h = (torch.randn(rows, 2 * inter, generator=g) * 6).to(torch.bfloat16)
    out = torch.ops.vllm_neuron.silu_and_mul(h)
    ref = _silu_reference(h)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, inter)
    # Within one bf16 step (2^-8 relative) of the exact value wherever it is a normal number; below ~1e-30
    # (gates under -70) exp's polynomial underflows first, which no sum of activations can see.
    torch.testing.assert_close(out.double(), ref, rtol=2 ** -8, atol=1e-30)
    # and mostly the same rounding as torch's fp32 silu * up: a few values on a rounding boundary differ
    torch_bf16 = (F.silu(h.float().chunk(2, -1)[0]) * h.float().chunk(2, -1)[1]).to(torch.bfloat16)
    assert (out != torch_bf16).float().mean() < 0.01


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 ** -7)])
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize("in_f,out_f,width", [(64, 192, 48), (1536, 576, 16), (576, 3072, 32)])
def test_lora_delta_matches_the_torch_form(dtype, tol, rows, in_f, out_f, width):
    """kernels/lora.cpp: each row shrunk and expanded by its own slot (slot 0 none) = model/layers/lora.py's
    torch form, in fp32 within rounding and in bf16 within one bf16 step of the output's scale."""
    from vllm_neuron.model.layers.lora import lora_delta

    g = torch.Generator().manual_seed(rows * 7 + in_f)
    a = (torch.randn(5, width, in_f, generator=g) * 0.1).to(dtype)
    b = (torch.randn(5, width, out_f, generator=g) * 0.1).to(dtype)
    a[0], b[0] = 0, 0
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    slot = torch.randint(0, 5, (rows,), generator=g)
    slot[0] = 0
    out = torch.ops.vllm_neuron.lora_delta(x, slot, a, b)
    ref = lora_delta(x.float(), slot, a.float(), b.float())
    assert out.dtype == dtype and out.shape == (rows, out_f)
    assert torch.equal(out[0], torch.zeros(out_f, dtype=dtype))
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_silu_and_mul_keeps_leading_dims_and_special_values():
    h = torch.tensor([[0.0, -0.0, 3.0, -3.0, 100.0, float("nan"), 1.0, 1.0, 2.0, 2.0, 1.0, 1.0]]).bfloat16()
    out = torch.ops.vllm_neuron.silu_and_mul(h.view(1, 1, 12))
    assert out.shape == (1, 1, 6)
    expected = _silu_reference(h)[0]
    torch.testing.assert_close(out.view(6)[:5].double(), expected[:5], rtol=2 ** -8, atol=0)
    assert torch.isnan(out.view(6)[5])
    non_contiguous = torch.randn(8, 2 * 64).bfloat16().t().contiguous().t()
    torch.testing.assert_close(torch.ops.vllm_neuron.silu_and_mul(non_contiguous).double(),
                               _silu_reference(non_contiguous), rtol=2 ** -8, atol=1e-30)


def test_silu_and_mul_refuses_what_it_cannot_compute():
    with pytest.raises(RuntimeError, match="silu_and_mul takes bf16"):
        torch.ops.vllm_neuron.silu_and_mul(torch.randn(2, 8))
    with pytest.raises(RuntimeError, match="even last dimension"):
        torch.ops.vllm_neuron.silu_and_mul(torch.randn(2, 7).bfloat16())


def test_mlp_activation_takes_the_kernel_for_bf16_only(monkeypatch):
    from vllm_neuron.model.layers import activation as A

    calls = []
    kernel = torch.ops.vllm_neuron.silu_and_mul
    monkeypatch.setattr(torch.ops.vllm_neuron, "silu_and_mul", lambda h: calls.append(h.dtype) or kernel(h),
                        raising=False)
    h = torch.randn(5, 2 * 96)
    gate, up = h.chunk(2, dim=-1)
    assert torch.equal(A.silu_and_mul(h, True), F.silu(gate) * up)  # fp32: torch's own, bit for bit
    torch.testing.assert_close(A.silu_and_mul(h.bfloat16(), True).double(), _silu_reference(h.bfloat16()),
                               rtol=2 ** -8, atol=1e-30)
    assert calls == [torch.bfloat16]
    A.silu_and_mul(h.bfloat16(), False)  # an engine (or a layer) whose KernelConfig has the kernel off
    assert calls == [torch.bfloat16]


def test_silu_and_mul_inside_a_compiled_graph():
    torch._dynamo.reset()
    f = torch.compile(lambda h: torch.ops.vllm_neuron.silu_and_mul(h) * 2, dynamic=False, fullgraph=True)
    h = torch.randn(16, 2 * 576).bfloat16()
    assert torch.equal(f(h), torch.ops.vllm_neuron.silu_and_mul(h) * 2)


def test_variant_detection():
    assert cpu_class.detect_variant({"avx512_bf16", "avx512bw", "avx2", "fma", "f16c"}) == "avx512bf16"
    assert cpu_class.detect_variant({"avx2", "fma", "f16c", "avx512f"}) == "avx2"
    assert cpu_class.detect_variant({"sse2"}) == "generic"
    assert tuple(build.VARIANTS) == cpu_class.CLASSES  # one build per class, best first


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("VLLM_NEURON_CPU_ISA")), reason="already the forced run")
def test_forced_avx2_build_passes_the_same_checks(tmp_path):
    """The AVX2 code paths (what an AVX2-only CPU runs), built here by forcing the class, against torch:
    attention, the bf16/fp32 linear and the int8/int4 linears at every bucket shape (both their paths: the
    integer dot products of test_int_dot_avx2 and the widening one).
    A process of its own: one process loads one build of the ops."""
    if cpu_class.detect_variant(caps.cpu_flags()) == "generic":
        pytest.skip("this CPU has no AVX2")
    if caps.kernel_variant()[0] == "avx2":  # an AVX2-only CPU: a second build would repeat the same checks
        pytest.skip("this process' own build is avx2: the tests above and test_quant_weights are the AVX2 checks")
    quant, int_dot = (os.path.join(os.path.dirname(__file__), f) for f in ("test_quant_weights.py",
                                                                            "test_int_dot_avx2.py"))
    proc = _forced_run("avx2", "not forced and (not test_quant_weights or dequantized_matmul or int16_rounding) and "
                       f"{_FORCED_SKIPS}", tmp_path, quant, int_dot)
    assert "skipped" not in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]  # every linear kernel ran


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("VLLM_NEURON_CPU_ISA")), reason="already the forced run")
def test_forced_generic_build_passes_the_attention_checks(tmp_path):
    """The baseline build (no linear kernels) runs the paged attention with sinks and windows, and the MLP
    activation, like the others."""
    _forced_run("generic", f"(paged_attention or silu) and not forced and {_FORCED_SKIPS}", tmp_path)


# What a forced build leaves out, to keep its cost (a whole second build) down: the compiled-graph check (the op's
# registration is the same in every build), the bf16 repeats of the long-prefill shapes (their fp32 runs take
# the same row-block and per-row paths) and the AMX compile checks (their -march is their own, whatever the build:
# 22 s each forced run).
_FORCED_SKIPS = "not compiled_graph and not (long_prefill_in_row_blocks and dtype1) and not builds_for_an_amx_cpu"


def _forced_run(variant: str, select: str, tmp_path, *more_files: str) -> subprocess.CompletedProcess:
    # A build of its own, in tmp_path (the kernel folder named: the subprocess' conftest would share the suite's).
    env = dict(os.environ, VLLM_NEURON_CPU_ISA=variant, VLLM_CACHE_ROOT=str(tmp_path),
               VLLM_NEURON_KERNEL_CACHE_DIR=str(tmp_path / "kernels"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", select, __file__,
                           *more_files],
                          env=env, capture_output=True, text=True, timeout=900, cwd=_REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout, proc.stdout[-2000:]
    assert [p.name for p in (tmp_path / "kernels").iterdir()], "nothing was built"
    return proc


def test_a_variant_the_cpu_cannot_run_is_refused():
    avx2_cpu = {"avx2", "fma", "f16c"}
    assert cpu_class.choose_variant(avx2_cpu, None) == ("avx2", "detected from /proc/cpuinfo")
    assert cpu_class.choose_variant(avx2_cpu, "generic")[0] == "generic"
    with pytest.raises(ValueError, match="VLLM_NEURON_CPU_ISA=avx512bf16 needs instructions this CPU lacks"):
        cpu_class.choose_variant(avx2_cpu, "avx512bf16")


def test_build_is_the_forced_variant():
    forced = os.environ.get("VLLM_NEURON_CPU_ISA")
    assert caps.kernel_variant()[0] == (forced or cpu_class.detect_variant(caps.cpu_flags()))


def test_only_the_registry_parses_torchs_registration_headers():
    """torch/library.h, the dispatcher and ATen/ops/*.h cost a source ~3 s of parsing each, a third of a cold
    build when every source paid it: the ops are registered in op_registry.cpp (linear_tile_copies.cpp needs the
    dispatcher for its lookup), and every op it registers is declared in op_table.h and defined in a source."""
    import re

    heavy = re.compile(r'#include <(torch/|ATen/ops/|ATen/core/dispatch/|ATen/ATen\.h)|TORCH_LIBRARY')
    kernels = os.path.dirname(build.__file__)
    read = {n: open(os.path.join(kernels, n)).read() for n in build.SOURCES + build.HEADERS}
    offenders = [n for n, text in read.items() if heavy.search(text)
                 and n not in ("op_registry.cpp", "linear_tile_copies.cpp")]
    assert offenders == []
    registered = set(re.findall(r'm\.def\("(\w+)\(', read["op_registry.cpp"]))
    assert "paged_attention" in registered and "linear_int8_amx" in registered
    declared = set(re.findall(r"^\S.*?\b(\w+)\(", read["op_table.h"], re.M))
    defined = {m for text in read.values() for m in re.findall(r"vn_ops::(\w+)\(", text)}
    assert registered <= declared and registered <= defined, (registered - declared, registered - defined)


def test_package_data_ships_every_kernel_source_and_header():
    """The kernels build from source on first use, so an installed package must carry every file the build
    reads (the headers were once left out of the package data)."""
    import fnmatch
    import tomllib

    with open(os.path.join(_REPO, "pyproject.toml"), "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["vllm_neuron.model.layers.kernels"]
    missing = [n for n in build.SOURCES + build.HEADERS if not any(fnmatch.fnmatch(n, p) for p in patterns)]
    assert missing == []


def _amx_object(source: str, tmp_path) -> str:
    """The disassembly of `source` built for Sapphire Rapids (AMX), whatever CPU runs the suite."""
    obj = str(tmp_path / (source.removesuffix(".cpp") + ".o"))
    done = subprocess.run(build.compile_command(source, obj, ("-march=sapphirerapids",)), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", obj], capture_output=True, text=True).stdout


def test_the_amx_linear_builds_for_an_amx_cpu_with_its_prefetch_rule(tmp_path):
    """No AMX CPU need run the suite, so the AMX kernel is built for one (Sapphire Rapids) and its object
    read: tile instructions, and both prefetch hints of its rule (the next block into L2 up to 32 rows,
    the block after next into L1 above). A source that stops building for AMX, or a rule that loses a
    branch, fails here rather than on the first AMX machine."""
    asm = _amx_object("linear_amx.cpp", tmp_path)
    for insn in ("tdpbf16ps", "tileloadd", "prefetcht0", "prefetcht1"):
        assert insn in asm, insn


def test_the_attention_kernel_builds_for_an_amx_cpu_with_its_tile_path(tmp_path):
    """The AMX tile path of prefill attention (attention_amx.h, sharing attention_bf16.h's packs and softmax)
    is compiled only for AMX targets: built here for Sapphire Rapids, its object must hold tile products."""
    asm = _amx_object("paged_attention.cpp", tmp_path)
    assert "tdpbf16ps" in asm and "vdpbf16ps" in asm


def test_the_int8_kernel_builds_for_an_amx_cpu_with_its_tile_path(tmp_path):
    """The W8A8 kernel built for an AMX-INT8 target holds tile products beside its VPDPBUSD path."""
    asm = _amx_object("linear_int8_tiles.cpp", tmp_path)
    assert "tdpbusd" in asm and "vpdpbusd" in asm
