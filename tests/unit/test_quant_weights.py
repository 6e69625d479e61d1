"""Weight-only int8 and int4: quantization error, the decode kernels and the prefill path against the
dequantized matmul at every default CPU bucket shape, compiled vs eager, in-place layer quantization,
and where the option is refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.test_int_dot_avx2 import INT_DOT_ROWS, codes, int_dot_bound
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.model.layers.kernels import ops
from vllm_neuron.model.layers.kernels.ops import has_op
from vllm_neuron.model.layers.kernels import cpu_caps as caps
from vllm_neuron.model.layers import quant_int4 as Q4
from vllm_neuron.model.layers import quant_int8 as Q8
from vllm_neuron.model.layers.quant_bands import from_bands, to_bands
from vllm_neuron.config.device import check_weight_quantization
from vllm_neuron.model.layers.linear import Linear, quantize_linears_

CPU = torch.device("cpu")
SCHEMES = {"int8": Q8, "int4": Q4}
DECODE_ROWS, PREFILL_ROWS = [1, 4, 16], [32, 64, 128, 256, 512]  # the default CPU buckets
# The bundled model's layer shapes (qkv, o, gate_up, down) and odd row counts (kernel tails).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (190, 576), (7, 64)]


def _weight(n: int = 48, k: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_band_layout_interleaves_each_bands_rows_chunk_by_chunk():
    t = torch.arange(6 * 8).reshape(6, 8)  # rows 0-3 form a band, rows 4-5 the short last one
    banded = to_bands(t, 4)
    assert banded.shape == t.shape and banded.is_contiguous()
    r = [list(range(8 * i, 8 * i + 8)) for i in range(6)]
    expected = (r[0][:4] + r[1][:4] + r[2][:4] + r[3][:4] + r[0][4:] + r[1][4:] + r[2][4:] + r[3][4:]
                + r[4][:4] + r[5][:4] + r[4][4:] + r[5][4:])
    assert banded.flatten().tolist() == expected
    for n in (1, 3, 4, 9):
        w = torch.randn(n, 32)
        assert torch.equal(from_bands(to_bands(w, 16), 16), w)
    with pytest.raises(ValueError, match="divisible by 16"):
        to_bands(torch.zeros(4, 40), 16)


def test_int4_error_is_at_most_half_a_step_per_group():
    w = _weight()
    deq = Q4.dequantize(*Q4.quantize(w), torch.float32)
    groups = w.reshape(w.shape[0], -1, Q4.GROUP_SIZE)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    err = (deq - w).abs().reshape_as(groups).amax(-1)
    assert torch.all(err <= step / 2 + 1e-6)
    assert deq.shape == w.shape and not torch.equal(deq, w)


def test_int8_error_is_at_most_half_a_step_per_channel():
    w = _weight()
    q, scale = Q8.quantize(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    err = (Q8.dequantize(q, scale, torch.float32) - w).abs().amax(1)
    assert torch.all(err <= scale / 2 + 1e-6) and torch.all(err > 0)


def test_int4_weights_on_a_4bit_grid_come_back_exactly():
    # What a Q4_1 GGUF holds: w = d * q + m per block of 32, every code 0..15 used in every block.
    n, k = 16, 128
    gen = torch.Generator().manual_seed(1)
    q = torch.stack([torch.randperm(Q4.GROUP_SIZE, generator=gen) % 16 for _ in range(n * k // 32)])
    d = torch.round((torch.rand(n * k // 32, 1, generator=gen) * 0.25 + 0.125) * 64) / 64
    m = torch.round(torch.randn(n * k // 32, 1, generator=gen) * 64) / 64
    w = (q.float() * d + m).reshape(n, k)
    packed, scales = Q4.quantize(w)
    assert packed.shape == (n, k // 2) and scales.shape == (n, k // 32, 2)
    assert torch.equal(Q4.dequantize(packed, scales, torch.float32), w)


def _reference(x, w_deq, bias):
    return F.linear(x.float(), w_deq.float(), None if bias is None else bias.float())


def _int_dot_atol(scheme: str, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> float:
    """0, or where an AVX2 build's kernel makes these rows int16 (int_dot_avx2.h), the most that rounding may add."""
    if not (ops.has_op("linear_quant_path") and x.shape[0] <= INT_DOT_ROWS):
        return 0.0
    return int_dot_bound(x, codes(scheme, q, s)).max().item()


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", SHAPES)
def test_kernel_and_prefill_path_match_the_dequantized_matmul_at_every_bucket(scheme, dtype, n, k):
    if not caps.quant_kernels_available(CPU):
        pytest.skip("this CPU has no AVX2: the int8/int4 kernels are not built and the torch path serves")
    mod = SCHEMES[scheme]
    g = torch.Generator().manual_seed(n + k)
    qweight, qscale = mod.quantize(torch.randn(n, k, generator=g) / k**0.5)
    w_deq = mod.dequantize(qweight, qscale, torch.float32)
    bias = torch.randn(n, generator=g).to(dtype)
    for rows in DECODE_ROWS + PREFILL_ROWS:
        x = torch.randn(rows, k, generator=g).to(dtype)
        ref = _reference(x, w_deq, bias)
        out = mod.linear(x, qweight, qscale, bias, caps.quant_kernel_rows(CPU, dtype))
        assert out.dtype == dtype and out.shape == (rows, n)
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 + _int_dot_atol(scheme, x, qweight, qscale))
        else:  # the output's bf16 rounding, and oneDNN's bf16 matmul on the prefill path (~3e-3 of the max)
            torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=5e-3 * ref.abs().max().item())
    # The kernel itself, every row count up to its largest, both N tails.
    for rows in range(1, caps.quant_kernel_rows(CPU, dtype) + 1):
        x = torch.randn(rows, k, generator=g).to(dtype)
        kernel = ops.linear_int8 if scheme == "int8" else ops.linear_int4
        ref = _reference(x, w_deq, None)
        if dtype == torch.float32:
            tol = dict(rtol=1e-5, atol=1e-5 + _int_dot_atol(scheme, x, qweight, qscale))
        elif scheme == "int4" and rows > 1 and caps.kernel_variant()[0] == "avx512bf16":
            # From 2 rows on, VDPBF16PS over the dequantized weight rounded to bf16 (as prefill's oneDNN
            # path uses it): the prefill tolerance.
            tol = dict(rtol=2**-7, atol=5e-3 * ref.abs().max().item())
        else:  # exact weights (int8 widens exactly to bf16 too): the output's rounding
            tol = dict(rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(kernel(x, qweight, qscale).float(), ref, **tol)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_widened_prefill_path_multiplies_bf16_rows_in_fp32(scheme, monkeypatch):
    """KernelConfig.matmul_dtype under widen_bf16 (the avx2 class): bf16 rows above the kernel's are unpacked to fp32 and multiplied
    there, rounded to bf16 once; without it they go to the matmul in bf16."""
    if not caps.quant_kernels_available(CPU):
        pytest.skip("this CPU has no AVX2: the int8/int4 kernels are not built and the torch path serves")
    mod = SCHEMES[scheme]
    g = torch.Generator().manual_seed(7)
    qweight, qscale = mod.quantize(torch.randn(96, 128, generator=g) / 128**0.5)
    bias = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(70, 128, generator=g).bfloat16()
    rows = caps.quant_kernel_rows(CPU, torch.bfloat16)
    assert 0 < rows < x.shape[0]
    seen = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda a, w, b=None: seen.append((a.dtype, w.dtype)) or linear(a, w, b))
    out = mod.linear(x, qweight, qscale, bias, rows, compute=torch.float32)
    assert seen == [(torch.float32, torch.float32)] and out.dtype == torch.bfloat16
    if scheme == "int8":
        expected = Q8.scaled_linear(x.float(), ops.unpack_int8(qweight, torch.float32), qscale).bfloat16() + bias
    else:
        expected = linear(x.float(), ops.unpack_int4(qweight, qscale, torch.float32), bias.float()).bfloat16()
    assert torch.equal(out, expected)
    seen.clear()
    mod.linear(x, qweight, qscale, bias, rows)
    assert seen == [(torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("n, k", [(12, 64), (9, 320), (960, 576), (7, 1536)])
def test_int4_kernel_on_bf16_rows_sees_exactly_the_prefill_paths_weights(n, k):
    """From 2 bf16 rows the int4 kernel widens each band to bf16 once (on AVX512-BF16 CPUs by a table per
    superblock) and prefill hands oneDNN unpack_int4's weights: the two must be the same bf16 values, or decode
    and prefill would run different models. One-hot input rows read single weights back exactly (one product,
    zeros elsewhere, and a bf16 weight fits the bf16 output), every column of every band and tail row, in calls
    of 2-4 rows and of up to 256; scales spread over 2^-20..2^20 exercise the rounding. An avx2 build takes
    integer products up to INT_DOT_ROWS rows (their rounding differs: test_int_dot_avx2.py bounds it), so there
    the calls above that many rows are checked."""
    if not caps.quant_kernels_available(CPU):
        pytest.skip("no AVX2 here: the torch path serves")
    integer_rows = INT_DOT_ROWS if has_op("linear_quant_path") else 1  # one row: test_int4_vnni.py
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g) * 2.0 ** (torch.randint(-20, 21, (n, 1), generator=g).float())
    q, sm = Q4.quantize(w)
    prefill_w = ops.unpack_int4(q, sm, torch.bfloat16)  # [n, k]
    # bf16 unpacks by table (int4_table.h, shared with the kernel's bands); the fp32 unpack widens each weight in
    # plain code: rounded to bf16, the same values.
    assert torch.equal(prefill_w, ops.unpack_int4(q, sm, torch.float32).bfloat16())
    for rows in (2, 3, 4, 256):  # one-hot rows for columns lo .. lo + rows - 1 per call (the last call: fewer)
        for lo in range(0, k if rows == 256 else min(k, 96), rows):
            cols = torch.arange(lo, min(k, lo + rows))
            if len(cols) <= integer_rows:
                continue  # the integer-product path, whose rounding differs
            x = torch.zeros(len(cols), k, dtype=torch.bfloat16)
            x[torch.arange(len(cols)), cols] = 1
            out = ops.linear_int4(x, q, sm)
            assert torch.equal(out, prefill_w[:, cols].T.contiguous()), f"{rows} rows: columns {lo}.."


@pytest.mark.parametrize("n, k", [(12, 48), (9, 272), (960, 576), (8, 1536)])
def test_int8_kernel_on_bf16_inputs_of_any_range_stays_within_the_int16_rounding(n, k):
    """bf16 inputs meet int8 weights as int16 (VPDPWSSD where the CPU has AVX512-VNNI, VPMADDWD in AVX2 builds):
    one power of two per
    row and block of 256 inputs, so an input within 2^7 of its block's largest is exact and a smaller one is
    off by at most 2^-15 of the largest. Inputs spread over 2^-30..2^8 stay within that bound; inputs of one
    narrow range (and all-zero rows) are exact up to the output's bf16 rounding. K of 3 and 17 chunks of 16
    leave an odd chunk count in the last block; 1-5 rows cover every row tile and the prefetching path, 8, 13
    and 16 the row groups of AMX CPUs (where VPDPWSSD serves up to 16 rows)."""
    if not caps.quant_kernels_available(CPU):
        pytest.skip("no AVX2 here: the torch path serves")
    g = torch.Generator().manual_seed(n * k)
    q, scale = Q8.quantize(torch.randn(n, k, generator=g) / k**0.5)
    w = Q8.dequantize(q, scale, torch.float32)
    for rows in (1, 2, 3, 4, 5, 8, 13, 16):
        wide = (torch.randn(rows, k, generator=g) * 2.0 ** (torch.rand(rows, k, generator=g) * 38 - 30)).bfloat16()
        narrow = (torch.randn(rows, k, generator=g) * 3).bfloat16()
        narrow[narrow.abs() < 0.25] = 0.25  # within 2^7 of the largest (~15)
        narrow[rows // 2] = 0  # a row of zeros
        for x, exact in ((wide, False), (narrow, True)):
            xf = x.float()
            ref = F.linear(xf, w)
            out = ops.linear_int8(x, q, scale).float()
            blocks = F.pad(xf.abs(), (0, -k % 256)).reshape(rows, -1, 256).amax(-1)
            step = blocks.repeat_interleave(256, dim=1)[:, :k] * 2.0**-14  # a block's step: <= 2^-14 of its largest
            bound = 0 if exact else (step / 2) @ w.abs().T
            sums = xf.abs() @ w.abs().T  # the fp32 sums' own rounding
            assert torch.all((out - ref).abs() <= bound + ref.abs() * 2**-8 + sums * 1e-6), (rows, exact)
        assert torch.all(ops.linear_int8(narrow, q, scale)[rows // 2] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", SHAPES)
def test_kernel_unpacking_equals_the_torch_dequantization(dtype, n, k):
    """The prefill path's one-pass unbanding gives back what the torch dequantization does: int8 exactly, int4
    up to the rounding of q * scale + min."""
    if not caps.quant_kernels_available(CPU):
        pytest.skip("no AVX2 here: the torch path serves")
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) / k**0.5
    q8, s8 = Q8.quantize(w)
    assert torch.equal(ops.unpack_int8(q8, dtype), from_bands(q8, Q8.CHUNK).to(dtype))
    q4, s4 = Q4.quantize(w)
    torch.testing.assert_close(ops.unpack_int4(q4, s4, dtype), Q4.dequantize(q4, s4, dtype))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("use_kernel", [False, True])
def test_torch_path_and_leading_dims(scheme, use_kernel):
    if use_kernel and not caps.quant_kernels_available(CPU):
        pytest.skip("no AVX2 here")
    mod = SCHEMES[scheme]
    qweight, qscale = mod.quantize(_weight())
    x = torch.randn(2, 3, 128)
    ref = F.linear(x, mod.dequantize(qweight, qscale, torch.float32))
    out = mod.linear(x, qweight, qscale, None, caps.quant_kernel_rows(CPU, x.dtype) if use_kernel else 0)
    assert out.shape == (2, 3, 48)
    extra = _int_dot_atol(scheme, x.reshape(6, 128), qweight, qscale) if use_kernel else 0.0
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 + extra)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("rows", [4, 40])
def test_compiled_equals_eager(scheme, rows):
    mod = SCHEMES[scheme]
    qweight, qscale = mod.quantize(_weight())
    kernel_rows = caps.quant_kernel_rows(CPU, torch.bfloat16)
    x = torch.randn(rows, 128).bfloat16()
    fn = torch.compile(lambda a: mod.linear(a, qweight, qscale, None, kernel_rows), fullgraph=True, dynamic=False)
    torch.testing.assert_close(fn(x), mod.linear(x, qweight, qscale, None, kernel_rows))


@pytest.mark.parametrize("scheme, ratio", [("int8", 0.27), ("int4", 0.19)])
def test_quantize_in_place_keeps_a_tied_weight_with_its_other_owner(scheme, ratio):
    emb = torch.nn.Embedding(64, 64)
    model = torch.nn.Module()
    model.embed, model.proj, model.head = emb, Linear(64, 96, bias=True), Linear(64, 64, bias=False)
    model.head.weight = emb.weight
    before_emb = emb.weight.detach().clone()
    x = torch.randn(3, 64)
    ref = F.linear(x, model.proj.weight, model.proj.bias)
    layers, before, after = quantize_linears_(model, scheme)
    assert layers == 2 and before == (96 * 64 + 64 * 64) * 4 and after < before * ratio
    assert torch.equal(emb.weight, before_emb) and "weight" not in dict(model.head.named_parameters())
    assert model.proj.quantization == scheme and model.head.qweight.shape[0] == 64
    torch.testing.assert_close(model.proj(x), ref, rtol=0.1, atol=0.2)  # quantization error only


def test_refused_off_cpu_for_other_dtypes_shapes_and_schemes():
    for scheme in ("int8", "int4"):
        with pytest.raises(ValueError, match="CPU device only"):
            check_weight_quantization(scheme, torch.float32, torch.device("cuda"))
        with pytest.raises(ValueError, match="dtype"):
            check_weight_quantization(scheme, torch.int8, CPU)
    with pytest.raises(ValueError, match="in_features divisible by 64"):
        Q4.quantize(torch.randn(16, 96))
    with pytest.raises(ValueError, match="in_features divisible by 16"):
        Q8.quantize(torch.randn(16, 40))
    with pytest.raises(ValueError, match="quantization='mxfp8' is not supported yet.*valid values: bf16 .*int8 .*int4"):
        EngineArgs.from_kwargs(device="cpu", additional_config={"neuron_config": {"quantization": "mxfp8"}})
    with pytest.raises(ValueError, match="quantization='mxfp4'.*not supported yet.*int8, int4"):
        check_weight_quantization("mxfp4", torch.float32, CPU)
    for scheme in ("int8", "int4"):
        EngineArgs.from_kwargs(device="cpu", additional_config={"neuron_config": {"quantization": scheme}})
