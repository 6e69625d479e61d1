"""int8 weights against int8 activations (kernels/linear_int8_tiles.cpp, quant_int8.to_tiles): the kernel
against its float64 reference (activations made int8 per row and group of 32, shifted to unsigned and the
weights' group sums taken back), the tile order read back exactly through one-hot rows, and the rows a quantized
`Linear` sends there; on AMX-INT8 CPUs the tile-product path against the VNNI one, bit for bit."""
from __future__ import annotations

import pytest
import torch

from vllm_neuron.model.layers import quant_int8 as Q8
from vllm_neuron.model.layers.kernel_config import resolve_kernel_config
from vllm_neuron.model.layers.kernels import cpu_caps as caps
from vllm_neuron.model.layers.kernels.ops import has_op
from vllm_neuron.model.layers.linear import Linear

pytestmark = pytest.mark.skipif(
    not (caps.kernels_enabled(torch.device("cpu")) and has_op("linear_int8_tiles")),
    reason="the W8A8 kernel is built for CPUs with AVX512-VNNI only")


def tiles_op(x, codes, corr, scale, bias=None):
    return torch.ops.vllm_neuron.linear_int8_tiles(x, codes, corr, scale, bias)


def quantized(n: int, k: int, seed: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, s = Q8.quantize(w)
    return q, s, *Q8.to_tiles(q)


@pytest.mark.parametrize("n, k", [(960, 576), (16, 32), (48, 96), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 13, 64])
def test_fp32_rows_match_the_reference(n, k, rows):
    q, s, codes, corr = quantized(n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 2 - 0.5
    x[0, :32] = 0  # a group of zeros: scale 0, codes 0
    ref = Q8.linear_w8a8_reference(x, q, s)
    out = tiles_op(x, codes, corr, s)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    tol = 1e-5 * (x.abs() @ Q8.dequantize(q, s, torch.float32).abs().T).double() + 1e-6
    assert ((out.double() - ref).abs() <= tol).all()


def test_bf16_rows_and_bias():
    q, s, codes, corr = quantized(192, 576, seed=3)
    x = torch.randn(9, 576).bfloat16()
    bias = torch.randn(192)
    out = tiles_op(x, codes, corr, s, bias)
    ref = Q8.linear_w8a8_reference(x, q, s) + bias.double()
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).abs() <= ref.abs() * 2**-8 + 1e-4).all()


def test_one_hot_rows_read_back_the_weights():
    q, s, codes, corr = quantized(64, 256, seed=5)
    out = tiles_op(torch.eye(256), codes, corr, s)
    torch.testing.assert_close(out, Q8.dequantize(q, s, torch.float32).T, rtol=1e-6, atol=1e-7)


def test_a_linear_takes_the_tiles_from_two_rows_and_the_vnni_kernel_at_one():
    kernels = resolve_kernel_config(torch.device("cpu"), torch.bfloat16)
    torch.manual_seed(0)
    lin = Linear(576, 192, bias=True).bfloat16()
    lin.kernels = kernels
    lin.quantize_("int8", tiles=True)
    assert hasattr(lin, "qtiles") and Q8.TILE_ROWS_FROM == 2
    x = torch.randn(5, 576).bfloat16()
    want = tiles_op(x, lin.qtiles, lin.qtile_extra, lin.qscale) + lin.bias
    torch.testing.assert_close(lin(x), want, rtol=0, atol=0)
    one = x[:1]
    torch.testing.assert_close(lin(one), torch.ops.vllm_neuron.linear_int8(one, lin.qweight, lin.qscale) + lin.bias,
                               rtol=0, atol=0)
    plain = Linear(576, 192, bias=False)
    plain.quantize_("int8")
    assert not hasattr(plain, "qtiles")


@pytest.mark.skipif(not has_op("linear_int8_amx"), reason="the AMX-INT8 path is built on CPUs with AMX only")
@pytest.mark.parametrize("rows", [1, 3, 15, 16, 17, 40, 64, 65, 130])
def test_the_amx_path_gives_the_vnni_paths_bits(rows):
    """linear_int8_amx (tile products, any row count) against linear_int8_tiles: below 16 rows the latter runs
    VPDPBUSD, from 16 rows the same tile path; the integer sums are exact either way and the float steps the
    same, so the bits agree, and both agree with the float64 reference. Rows past 64 take several passes."""
    q, s, codes, corr = quantized(576, 1536, seed=rows)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(576)
    amx = torch.ops.vllm_neuron.linear_int8_amx(x, codes, corr, s, bias)
    if rows < 16:
        torch.testing.assert_close(amx, tiles_op(x, codes, corr, s, bias), rtol=0, atol=0)
    ref = Q8.linear_w8a8_reference(x, q, s) + bias.double()
    tol = 1e-5 * (x.abs() @ Q8.dequantize(q, s, torch.float32).abs().T).double() + 1e-5
    assert ((amx.double() - ref).abs() <= tol).all()
    xb = x.bfloat16()
    torch.testing.assert_close(torch.ops.vllm_neuron.linear_int8_amx(xb[:3], codes, corr, s, bias),
                               tiles_op(xb[:3], codes, corr, s, bias), rtol=0, atol=0)
