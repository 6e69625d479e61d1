"""The custom CPU kernels against plain torch: paged attention (prefill with cached context, decode,
padding rows) and the bf16 small-batch linear, in fp32 and bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_neuron.model.layers import kernels as K
from vllm_neuron.model.layers import linear as L

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def built():
    assert K.kernels_enabled(CPU), "the custom CPU kernels failed to build (see the log)"


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
    out = K.paged_attention(q, kc, vc, tables, starts, positions, 0.125, bs)
    ref = _reference(q, kc, vc, tables, starts, positions, 0.125, bs)
    torch.testing.assert_close(out[:45].float(), ref[:45], atol=tol, rtol=tol)
    assert torch.equal(out[45:], torch.zeros_like(out[45:]))  # padding rows
    # Decode: one row per sequence, lengths across block and tile edges.
    positions = torch.tensor([0, 31, 159])
    q = torch.randn(3, heads, d, generator=g).to(dtype)
    out = K.paged_attention(q, kc, vc, tables, torch.arange(4), positions, 0.125, bs)
    torch.testing.assert_close(out.float(), _reference(q, kc, vc, tables, torch.arange(4), positions, 0.125, bs),
                               atol=tol, rtol=tol)


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
    K.paged_attention(**_attention_inputs())  # the valid inputs run
    with pytest.raises(RuntimeError, match=message):
        K.paged_attention(**{**_attention_inputs(), **change})


@pytest.mark.parametrize("rows", [1, 3, 4])
@pytest.mark.parametrize("n, k", [(1536, 576), (576, 1536), (190, 576), (7, 64)])
def test_linear_bf16_matches_fp32_matmul(rows, n, k):
    if not K.linear_kernel_available(CPU):
        pytest.skip("this CPU has no AVX512-BF16: the kernel is not built and F.linear serves")
    g = torch.Generator().manual_seed(n + rows)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    ref = x.float() @ w.float().t()
    out = K.linear_bf16(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # Products are exact in fp32; the error is the bf16 rounding of the result (plus summation order,
    # visible only where the sum cancels to near zero).
    torch.testing.assert_close(out.float(), ref, atol=1e-4 * ref.abs().max().item(), rtol=2 ** -8)


def test_linear_layer_takes_the_kernel_only_for_small_bf16_batches(monkeypatch):
    calls = []
    monkeypatch.setattr(K, "linear_bf16", lambda x, w: calls.append(x.shape[0]) or F.linear(x, w))
    layer = L.Linear(64, 32, bias=False).bfloat16()
    L.set_small_batch_kernel(True)
    try:
        layer(torch.randn(L.SMALL_BATCH_ROWS, 64).bfloat16())
        layer(torch.randn(L.SMALL_BATCH_ROWS + 1, 64).bfloat16())  # prefill-sized: oneDNN
        layer.float()(torch.randn(2, 64))  # fp32: never the bf16 kernel
        L.set_small_batch_kernel(False)
        layer.bfloat16()(torch.randn(1, 64).bfloat16())
    finally:
        L.set_small_batch_kernel(False)
    assert calls == [L.SMALL_BATCH_ROWS]
