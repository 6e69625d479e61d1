"""int4 weights against int8 activations (kernels/linear_int4_tiles.cpp, quant_int4.to_tiles): the kernel
against its float64 reference (activations made int8 per row and group of 32, the groups' exact sums for the
minimums), the tile order read back exactly through one-hot rows and by `tile_groups`, rows independent of
each other, and a quantized `Linear` holding the tile copy alone and sending every row count there."""
from __future__ import annotations

import pytest
import torch

from vllm_neuron.model.layers import quant_int4 as Q4
from vllm_neuron.model.layers.kernel_config import KernelConfig, resolve_kernel_config
from vllm_neuron.model.layers.kernels import cpu_caps as caps
from vllm_neuron.model.layers.kernels.ops import has_op
from vllm_neuron.model.layers.linear import Linear

pytestmark = pytest.mark.skipif(
    not (caps.kernels_enabled(torch.device("cpu")) and has_op("linear_int4_tiles")),
    reason="the W4A8 kernel is built for CPUs with AVX512-VNNI only")


def tiles_op(x, codes, scales, bias=None):
    return torch.ops.vllm_neuron.linear_int4_tiles(x, codes, scales, bias)


def quantized(n: int, k: int, seed: int, offset: float = 0.0):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05 + offset
    q, s = Q4.quantize(w)
    return q, s, *Q4.to_tiles(q, s)


@pytest.mark.parametrize("n, k", [(960, 576), (16, 64), (48, 192), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 13, 64])
def test_fp32_rows_match_the_reference(n, k, rows):
    q, s, codes, scales = quantized(n, k, seed=n + k, offset=0.3)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2
    x[0, :32] = 0  # a group of zeros: scale 0, codes 0, no division by zero
    ref = Q4.linear_w4a8_reference(x, codes, scales)
    out = tiles_op(x, codes, scales)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    tol = 1e-5 * (x.abs() @ Q4.dequantize(q, s, torch.float64).abs().T.float()).double() + 1e-6
    assert ((out.double() - ref).abs() <= tol).all()


def test_bf16_rows_and_bias():
    q, s, codes, scales = quantized(192, 576, seed=3)
    x = torch.randn(9, 576).bfloat16()
    bias = torch.randn(192)
    out = tiles_op(x, codes, scales, bias)
    ref = Q4.linear_w4a8_reference(x, codes, scales) + bias.double()
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-4).all()  # bf16 output rounding


def test_one_hot_rows_read_back_the_weights():
    """A one-hot row quantizes exactly (127 * 1/127), so row k of the output is column k of the dequantized
    weight: every code and (scale, min) pair sits where the kernel reads it."""
    q, s, codes, scales = quantized(64, 256, seed=5, offset=-0.2)
    out = tiles_op(torch.eye(256), codes, scales)
    torch.testing.assert_close(out, Q4.dequantize(q, s, torch.float32).T, rtol=1e-6, atol=1e-6)


def test_tile_groups_read_the_copy_back_in_row_order():
    """`tile_groups` / `dequantize_tiles` (what the engine reads when the copy replaced the bands) give the bands'
    codes and weights back, also for whole 16-column blocks of the copy."""
    q, s, codes, scales = quantized(48, 192, seed=6, offset=0.1)
    b = Q4.from_bands(q, Q4.SUPERBLOCK // 2).reshape(48, -1, 1, Q4.GROUP_SIZE)
    want = torch.cat([b & 15, b >> 4], 2).reshape(48, -1, Q4.GROUP_SIZE)
    got, sm = Q4.tile_groups(codes, scales)
    assert torch.equal(got, want)
    deq = Q4.dequantize(q, s, torch.float32)
    torch.testing.assert_close(Q4.dequantize_tiles(codes, scales, torch.float32), deq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(Q4.dequantize_tiles(codes[16:32], scales[16:32], torch.float32), deq[16:32],
                               rtol=1e-6, atol=1e-6)


def test_rows_do_not_depend_on_each_other():
    q, s, codes, scales = quantized(96, 320 - 64, seed=8)
    x = torch.randn(11, 256)
    alone = torch.cat([tiles_op(x[i:i + 1], codes, scales) for i in range(11)])
    assert torch.equal(tiles_op(x, codes, scales), alone)


def test_int8_activations_are_not_the_full_precision_product():
    """The activations really are rounded to int8: a row with one large and many small entries per group loses
    the small ones' digits, which the W4A16 product keeps."""
    q, s, codes, scales = quantized(32, 64, seed=2)
    x = torch.full((2, 64), 0.003)
    x[:, ::32] = 1.0
    exact = x.double() @ Q4.dequantize(q, s, torch.float64).T
    out = tiles_op(x, codes, scales).double()
    assert (out - exact).abs().max() > 1e-4
    assert torch.allclose(out, Q4.linear_w4a8_reference(x, codes, scales), atol=1e-6)


def test_a_linear_holds_the_tiles_alone_and_takes_them_at_every_row_count():
    kernels = resolve_kernel_config(torch.device("cpu"), torch.bfloat16)
    assert kernels.int8_activations
    torch.manual_seed(0)
    lin = Linear(576, 192, bias=False).bfloat16()
    lin.kernels = kernels
    weight = lin.weight.detach().clone()
    lin.quantize_("int4", tiles=True)
    assert hasattr(lin, "qtiles") and not hasattr(lin, "qweight") and not hasattr(lin, "qscale")
    assert sum(t.numel() * t.element_size() for t in lin.buffers(recurse=False)) == 576 * 192 * 3 // 4
    for rows in (1, 2, 5, 70):
        x = torch.randn(rows, 576).bfloat16()
        torch.testing.assert_close(lin(x), tiles_op(x, lin.qtiles, lin.qtile_extra), rtol=0, atol=0)
    from vllm_neuron.model.layers.linear import _dequantize_rows

    assert (_dequantize_rows(lin, 0, 192) - weight.float()).abs().max() < 0.05  # the error measure reads the copy


def test_without_int8_activations_no_linear_holds_tiles():
    assert not resolve_kernel_config(torch.device("cpu"), torch.bfloat16, int8_activations=False).int8_activations
    assert not KernelConfig().int8_activations  # layers outside an engine: the bands
    lin = Linear(576, 192, bias=False).bfloat16()
    lin.quantize_("int4")
    assert not hasattr(lin, "qtiles")
    unaligned = Linear(64, 40, bias=False)  # N not a multiple of 16: the bands only
    unaligned.quantize_("int4", tiles=True)
    assert not hasattr(unaligned, "qtiles")


def test_the_copies_are_refused_where_memory_is_short(monkeypatch):
    from vllm_neuron.model.layers.linear import tile_bytes
    from vllm_neuron.worker import model_setup

    model = torch.nn.Sequential(Linear(576, 192, bias=False), Linear(64, 40, bias=False))
    assert tile_bytes(model, "int8") == 576 * 192 * 9 // 8  # the unaligned layer gets none
    assert tile_bytes(model, "int4") == 0  # int4's copy replaces its bands
    assert tile_bytes(model, "int4", {"0": "int8"}) == 576 * 192 * 9 // 8  # a layer of a GGUF's own int8
    need = tile_bytes(model, "int8")
    monkeypatch.setattr(model_setup.memory, "host_available_bytes", lambda: 2 * need - 2)
    assert not model_setup.tiles_fit_memory(model, "int8")
    assert model_setup.tiles_fit_memory(model, "int4")
    monkeypatch.setattr(model_setup.memory, "host_available_bytes", lambda: 2 * need)
    assert model_setup.tiles_fit_memory(model, "int8")
