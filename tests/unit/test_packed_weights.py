"""Linears on weights packed once (AVX512-BF16 and AMX CPUs): oneDNN's reordered copy and the tile kernels'
(AMX tiles, VDPBF16PS dot products), same results as F.linear, each taken only where switched on and for its
rows; no copies where they would not fit in memory."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vllm_neuron.model.layers import linear as L
from vllm_neuron.model.layers import packed_weights as P
from vllm_neuron.model.layers.kernel_config import KernelConfig
from vllm_neuron.model.layers.kernels import cpu_caps as caps
from vllm_neuron.model.layers.kernels.ops import has_op, pack_tiles

CPU = torch.device("cpu")
# What an engine's KernelConfig.tile_rows would be here: the C++ lookup serves the tile kernel's rows.
_TILE = caps.tile_kernel()  # (builds the kernels first)
TILE_ROWS = _TILE[1] if _TILE is not None and has_op("linear_tiles") else 0
AMX = {"amx_bf16", "amx_tile", "avx512_bf16", "avx512bw"}

pytestmark = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="this CPU has no oneDNN bf16 path (no AVX-512): F.linear serves, no reorder")


def test_only_bf16_on_a_cpu_with_bf16_dot_products_reorders():
    assert caps.packing_pays(CPU, torch.bfloat16, AMX)
    assert caps.packing_pays(CPU, torch.bfloat16, {"avx512_bf16", "avx512bw"})  # AVX512-BF16 without AMX
    assert not caps.packing_pays(CPU, torch.float32, AMX)  # no fp32 reorder: the kernel serves fp32 decode sizes
    assert not caps.packing_pays(CPU, torch.bfloat16, {"avx512f", "avx512bw"})  # AVX-512 without bf16 dot products
    assert not caps.packing_pays(CPU, torch.bfloat16, {"avx2", "fma"})  # oneDNN emulates bf16 there
    assert not caps.packing_pays(torch.device("cuda"), torch.bfloat16, AMX)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(96, 64)
        self.up = L.Linear(64, 160, bias=False)
        self.down = L.Linear(160, 64, bias=True)
        self.head = L.Linear(64, 96, bias=False)
        self.head.weight = self.embed.weight  # tied: one reorder
        self.quant = L.Linear(64, 32, bias=False)


def _model() -> _Tiny:
    torch.manual_seed(0)
    m = _Tiny().bfloat16().requires_grad_(False)
    m.quant.quantize_("int8")
    return m


@pytest.mark.parametrize("rows", [5, 16, 33, 128])
def test_reordered_linears_match_f_linear(rows):
    m = _model()
    layers, added = L.pack_linears_(m)
    copies = 2 if caps.tile_kernel_built() else 1  # every shape here fits the tile kernel
    # the int8 layer keeps its own path
    assert layers == 3 and added == (160 * 64 + 64 * 160 + 96 * 64) * 2 * copies
    x = torch.randn(rows, 64).bfloat16()
    h = F.linear(x, m.up.weight)
    for layer, inp in ((m.up, x), (m.down, h), (m.head, x)):
        out = P.linear_prepacked(inp, layer.weight, layer.bias, TILE_ROWS)
        ref = F.linear(inp, layer.weight, layer.bias)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2 ** -7)


def test_copies_are_made_only_where_they_fit_in_half_the_available_memory(monkeypatch, caplog):
    from vllm_neuron.worker import memory
    from vllm_neuron.worker.model_setup import pack_weights

    m = _model()
    need = L.packed_bytes(m)
    copies = 2 if caps.tile_kernel_built() else 1
    assert need == (160 * 64 + 64 * 160 + 96 * 64) * 2 * copies  # the tied head once, the int8 layer never
    kernels = KernelConfig(linear_rows=32, prepacked=True)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 2 * need - 2)
    pack_weights(m, kernels)
    assert m.up.weight.data_ptr() not in P._packed and "Weights not packed" in caplog.text
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 2 * need)
    pack_weights(m, kernels)
    assert all(layer.weight.data_ptr() in P._packed for layer in (m.up, m.down, m.head))
    assert L.packed_bytes(m) == 0  # nothing left to copy


def _forged(layer: L.Linear) -> torch.Tensor:
    """Registers 2 * weight as `layer`'s reordered copy, so that a result tells which path ran."""
    w = layer.weight
    P._packed[w.data_ptr()] = (w.shape, torch.ops.mkldnn._reorder_linear_weight(2 * w, 16), None, None, 0)
    return w


@pytest.mark.parametrize("compiled", [False, True])
def test_the_layer_takes_the_reordered_weight_only_when_switched_on_and_above_the_kernel_rows(compiled, monkeypatch):
    torch.manual_seed(1)
    layer = L.Linear(64, 48, bias=False).bfloat16().requires_grad_(False)
    _forged(layer)
    x = torch.randn(8, 64).bfloat16()
    ref = F.linear(x, layer.weight)
    fn = torch.compile(layer, backend="inductor", fullgraph=True) if compiled else layer
    try:
        layer.kernels = KernelConfig(prepacked=True)  # tile_rows 0: oneDNN's copy alone, as without tile kernels
        torch._dynamo.reset()
        torch.testing.assert_close(fn(x).float(), 2 * ref.float(), atol=2e-2, rtol=2 ** -7)
        layer.kernels = KernelConfig()
        torch._dynamo.reset()
        torch.testing.assert_close(fn(x).float(), ref.float(), atol=2e-2, rtol=2 ** -7)
    finally:
        torch._dynamo.reset()
        P._packed.pop(layer.weight.data_ptr())  # a forged copy must not outlive this test


def test_a_weight_without_its_reordered_copy_takes_f_linear_and_copies_leave_with_their_weights():
    torch.manual_seed(2)
    m = _model()
    L.pack_linears_(m)
    x = torch.randn(16, 64).bfloat16()
    other = torch.randn(160, 64).bfloat16()  # never reordered
    torch.testing.assert_close(P.linear_prepacked(x, other, None, TILE_ROWS), F.linear(x, other))
    # A view over the same storage with another shape must not find the copy of the whole weight.
    half = m.up.weight[:80]
    torch.testing.assert_close(P.linear_prepacked(x, half, None, TILE_ROWS), F.linear(x, half))
    ptrs = [m.up.weight.data_ptr(), m.down.weight.data_ptr()]
    assert all(p in P._packed for p in ptrs)
    del m, half
    gc.collect()
    assert not any(p in P._packed for p in ptrs)


_tiles = pytest.mark.skipif(not caps.tile_kernel_built(),
                            reason="no AMX tile kernel in this machine's build (a CPU without AMX): oneDNN serves")
_any_tiles = pytest.mark.skipif(caps.tile_kernel() is None,
                                reason="no tile kernel in this machine's build (no AVX512-BF16): oneDNN serves")


@_any_tiles
@pytest.mark.parametrize("n, k", [(48, 64), (80, 96), (960, 576), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 48, 64, 65, 100, 129])
def test_tile_kernel_matches_the_fp32_product_rounded_once(n, k, rows):
    op, most = caps.tile_kernel()
    if rows > most:
        pytest.skip(f"the AMX tile kernel serves up to {most} rows; oneDNN's copy above (tested below)")
    g = torch.Generator().manual_seed(rows * 7 + n)
    w = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    tiles = pack_tiles(w)
    for b in (None, bias):
        ref = x.float() @ w.float().t() + (0 if b is None else b.float())
        out = op(x, tiles, b, n)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
        # exact products summed in fp32, rounded to bf16 once: within bf16's half step plus fp32 summation
        torch.testing.assert_close(out.float(), ref, atol=1e-3 * k ** 0.5, rtol=2 ** -8)


@pytest.mark.skipif(not caps.dot_kernel_built(), reason="no AVX512-BF16 build here: no dot-product tile kernel")
def test_dot_kernel_takes_every_row_of_a_strided_input_and_refuses_what_it_cannot_index():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 64, generator=g).bfloat16()
    tiles = pack_tiles(w)
    x = torch.randn(300, 128, generator=g).bfloat16()[:, ::2]  # not contiguous
    torch.testing.assert_close(torch.ops.vllm_neuron.linear_dot_tiles(x, tiles, None, 48).float(),
                               x.float() @ w.float().t(), atol=1e-2, rtol=2 ** -8)
    assert torch.ops.vllm_neuron.linear_dot_tiles(x[:0], tiles, None, 48).shape == (0, 48)
    with pytest.raises(RuntimeError, match="tile order"):
        torch.ops.vllm_neuron.linear_dot_tiles(x[:8], tiles[:2], None, 48)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.vllm_neuron.linear_dot_tiles(torch.randn(8, 48).bfloat16(), tiles, None, 64)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.vllm_neuron.linear_dot_tiles(x[:8], tiles, torch.zeros(48), 48)


@pytest.mark.skipif(caps.tile_kernel_built() or not caps.dot_kernel_built(),
                    reason="the dot-product tile kernel serves where there is no AMX tile kernel")
@pytest.mark.parametrize("compiled", [False, True])
def test_without_amx_the_tile_copy_serves_every_row_and_oneDNN_gets_no_copy(compiled):
    m = _model()
    L.pack_linears_(m)
    shape, reordered, tiles, op, rows = P._packed[m.up.weight.data_ptr()]
    assert reordered is None and tiles is not None and op == torch.ops.vllm_neuron.linear_dot_tiles
    torch.manual_seed(4)
    layer = L.Linear(64, 48, bias=False).bfloat16().requires_grad_(False)
    w = layer.weight
    # a forged copy (2w) tells which path ran
    P.register(w, None, pack_tiles(2 * w), op, rows)
    fn = torch.compile(layer, backend="inductor", fullgraph=True) if compiled else layer
    try:
        layer.kernels = KernelConfig(prepacked=True, tile_rows=TILE_ROWS)
        torch._dynamo.reset()
        for n in (5, 32, 33, 512):
            x = torch.randn(n, 64).bfloat16()
            torch.testing.assert_close(fn(x).float(), 2 * F.linear(x, w).float(), atol=2e-2, rtol=2 ** -7)
    finally:
        torch._dynamo.reset()
        P.forget(w.data_ptr())


@_tiles
@pytest.mark.parametrize("compiled", [False, True])
def test_the_tile_copy_serves_up_to_its_rows_and_the_reordered_copy_above(compiled):
    torch.manual_seed(3)
    layer = L.Linear(64, 48, bias=False).bfloat16().requires_grad_(False)
    w = layer.weight
    # forged copies (2w for the tile kernel, 3w for oneDNN) tell which path ran
    P.register(w, torch.ops.mkldnn._reorder_linear_weight(3 * w, 16), pack_tiles(2 * w),
               torch.ops.vllm_neuron.linear_amx, caps.AMX_ROWS)
    fn = torch.compile(layer, backend="inductor", fullgraph=True) if compiled else layer
    try:
        layer.kernels = KernelConfig(prepacked=True, tile_rows=TILE_ROWS)
        torch._dynamo.reset()
        for rows, factor in ((5, 2), (caps.AMX_ROWS, 2), (caps.AMX_ROWS + 1, 3), (64, 3)):
            x = torch.randn(rows, 64).bfloat16()
            torch.testing.assert_close(fn(x).float(), factor * F.linear(x, w).float(), atol=2e-2, rtol=2 ** -7)
    finally:
        torch._dynamo.reset()
        P.forget(w.data_ptr())


@_tiles
def test_tile_kernel_refuses_what_it_cannot_index():
    w = torch.randn(48, 64).bfloat16()
    tiles = pack_tiles(w)
    with pytest.raises(RuntimeError, match="1 to 64 rows"):
        torch.ops.vllm_neuron.linear_amx(torch.randn(65, 64).bfloat16(), tiles, None, 48)
    with pytest.raises(RuntimeError, match="tile order"):
        torch.ops.vllm_neuron.linear_amx(torch.randn(8, 64).bfloat16(), tiles[:2], None, 48)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.vllm_neuron.linear_amx(torch.randn(8, 48).bfloat16(), tiles, None, 64)
    assert not P.tile_kernel_fits(torch.randn(40, 64).bfloat16())  # N not a multiple of 16


@_tiles
def test_an_amx_tile_kernel_that_cannot_run_leaves_its_rows_to_the_dot_kernel_or_onednn(monkeypatch):
    def no_tile_state(*args):
        raise RuntimeError("the kernel did not get the AMX tile state from the OS")

    monkeypatch.setattr(torch.ops.vllm_neuron, "linear_amx", no_tile_state)
    caps.tile_kernel_built.cache_clear()
    try:
        assert not caps.tile_kernel_built()
        assert P.tile_kernel_fits(torch.randn(48, 64).bfloat16()) == caps.dot_kernel_built()
    finally:
        monkeypatch.undo()
        caps.tile_kernel_built.cache_clear()
    assert caps.tile_kernel_built()


@_any_tiles
def test_the_cpp_lookup_takes_the_registered_tile_copy_within_its_rows_and_f_linear_otherwise():
    torch.manual_seed(5)
    w = torch.randn(48, 64).bfloat16()
    op, _ = caps.tile_kernel()
    lin = torch.ops.vllm_neuron.linear_tiles
    x, x9 = torch.randn(8, 64).bfloat16(), torch.randn(9, 64).bfloat16()
    P.register(w, None, pack_tiles(2 * w), op, 8)  # a forged copy (2w) tells which path ran
    try:
        torch.testing.assert_close(lin(x, w, None).float(), 2 * F.linear(x, w).float(), atol=2e-2, rtol=2 ** -7)
        torch.testing.assert_close(lin(x9, w, None), F.linear(x9, w))  # more rows than the copy serves
        torch.testing.assert_close(lin(x, w[:32], None), F.linear(x, w[:32]))  # another shape, same storage
    finally:
        P.forget(w.data_ptr())
    torch.testing.assert_close(lin(x, w, None), F.linear(x, w))  # forgotten


@_any_tiles
def test_traced_layers_look_their_tile_copy_up_in_cpp():
    """Within the tile kernel's rows a graph calls the C++ lookup, not the Python kernel: where the two
    registries disagree (forged: 2w for C++, 3w for Python) the graph computes with 2w."""
    torch.manual_seed(6)
    layer = L.Linear(64, 48, bias=False).bfloat16().requires_grad_(False)
    w = layer.weight
    op, rows = caps.tile_kernel()
    P.register(w, None, pack_tiles(2 * w), op, rows)
    P._packed[w.data_ptr()] = (w.shape, None, pack_tiles(3 * w), op, rows)
    fn = torch.compile(layer, backend="inductor", fullgraph=True)
    try:
        layer.kernels = KernelConfig(prepacked=True, tile_rows=TILE_ROWS)
        torch._dynamo.reset()
        x = torch.randn(16, 64).bfloat16()
        torch.testing.assert_close(fn(x).float(), 2 * F.linear(x, w).float(), atol=2e-2, rtol=2 ** -7)
    finally:
        torch._dynamo.reset()
        P.forget(w.data_ptr())


@_any_tiles
def test_the_tile_copies_lie_side_by_side_in_one_huge_page_mapping(monkeypatch):
    from vllm_neuron import huge_pages
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    m = _model()
    L.pack_linears_(m)
    try:
        tiles = [P._packed[w.data_ptr()][2] for w in (m.up.weight, m.down.weight, m.head.weight)]
        assert tiles[0].data_ptr() % huge_pages.PAGE == 0
        for a, b in zip(tiles, tiles[1:]):  # in the model's order, each at the next 4 KiB boundary
            assert b.data_ptr() == a.data_ptr() + huge_pages.Arena.footprint(a)
        for t, w in zip(tiles, (m.up.weight, m.down.weight, m.head.weight)):
            torch.testing.assert_close(t, pack_tiles(w, lambda v: v.contiguous()), rtol=0, atol=0)
    finally:
        for w in (m.up.weight, m.down.weight, m.head.weight):
            P.forget(w.data_ptr())
