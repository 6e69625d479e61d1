"""The AVX2 build's int8 / int4 decode linears by integer dot products (kernels/int_dot_avx2.h) against the
dequantized matmul, within the rounding of the inputs made int16 that the header states, at every row tile and
with K not a multiple of the input block and N not a multiple of the band; the row counts that take it; and
inputs that must come out exact or NaN.

Only an avx2 build has the path: on an AVX2-only CPU these run as they are; elsewhere test_kernels' forced
avx2 run (one build, shared with its other checks) runs this file."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_neuron.model.layers import quant_int4 as Q4
from vllm_neuron.model.layers import quant_int8 as Q8
from vllm_neuron.model.layers.kernels import cpu_caps as caps
from vllm_neuron.model.layers.kernels.ops import has_op

BLOCK = 256  # inputs per int16 factor (int_dot_avx2.h's kBlock)
INT_DOT_ROWS = 16  # up to this many rows linear_int8 / linear_int4 take it (linear_quant.cpp's kIntDotRows)


@pytest.fixture(scope="module", autouse=True)
def int_dot_build():
    if not (caps.quant_kernels_available(torch.device("cpu")) and has_op("linear_quant_path")):
        pytest.skip("the integer-dot path is in avx2 builds only: test_kernels' forced avx2 run runs this file")


def path(x, q, s, name):
    return torch.ops.vllm_neuron.linear_quant_path(x, q, s, name)


def int_dot_bound(x: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The most an output may differ from the dequantized matmul when each input is rounded to its block's step,
    2^(e - 15) for a block's largest magnitude below 2^e (2^(e + 1 - 15) when it would round to 2^15): the sum of
    step / 2 * |w| (|codes|: the part of each weight that multiplies the rounded inputs; int4's minimum meets
    the exact sum)."""
    xf = x.float()
    k = xf.shape[1]
    amax = F.pad(xf.abs(), (0, -k % BLOCK)).reshape(xf.shape[0], -1, BLOCK).amax(-1)
    e = torch.frexp(amax).exponent
    e = e + (amax * torch.exp2(15.0 - e) >= 32767.5)
    step = torch.exp2(e - 15.0)
    return (step.repeat_interleave(BLOCK, dim=1)[:, :k] / 2) @ codes.abs().T


def codes(scheme: str, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What multiplies the rounded inputs: the int8 weight, int4's q * scale (without the group's minimum)."""
    mod = Q8 if scheme == "int8" else Q4
    deq = mod.dequantize(q, s, torch.float32)
    return deq if scheme == "int8" else deq - Q4.dequantize(torch.zeros_like(q), s, torch.float32)


def weights(scheme: str, n: int, k: int, seed: int, offset: float = 0.0):
    """(q, scales, dequantized fp32 weight, codes) of a random [n, k] weight."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5 + offset
    mod = Q8 if scheme == "int8" else Q4
    q, s = mod.quantize(w)
    return q, s, mod.dequantize(q, s, torch.float32), codes(scheme, q, s)


def check(x: torch.Tensor, q, s, deq, codes) -> None:
    raw = path(x, q, s, "int_dot")
    ref = F.linear(x.float().double(), deq.double()).float()
    assert raw.dtype == x.dtype and raw.shape == ref.shape
    bound = int_dot_bound(x, codes)
    sums = x.float().abs() @ deq.abs().T  # the fp32 sums' own rounding
    slack = sums * 2e-6 + (0 if x.dtype == torch.float32 else (ref.abs() + bound) * 2**-8)  # a bf16 output's
    excess = (raw.float() - ref).abs() - bound - slack
    assert excess.max().item() <= 0, (x.shape, q.shape, excess.max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(960, 576), (7, 48), (9, 272), (6, 16), (190, 1536), (1, 64), (3, 112)])
def test_int8_within_the_input_rounding_at_every_row_tile(n, k, dtype):
    """K of 1, 3, 7 and 17 chunks of 16 leave a short last block (and 576 one of 64 inputs); N of 1, 3, 6, 7, 9 and
    190 every band tail; rows 1-9 every row tile and a second block of four, 16 the largest the kernel takes, 21
    beyond."""
    q, s, deq, codes = weights("int8", n, k, seed=n * k)
    g = torch.Generator().manual_seed(k)
    for rows in (*range(1, 10), 16, 21):
        check(torch.randn(rows, k, generator=g).to(dtype), q, s, deq, codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(960, 576), (7, 64), (9, 192), (190, 1536), (2, 128)])
@pytest.mark.parametrize("offset", [0.0, 3.0])
def test_int4_within_the_input_rounding_at_every_row_tile(n, k, dtype, offset):
    """The bound counts only q * scale: the groups' minimums (large with the offset) meet the inputs' exact sums."""
    q, s, deq, codes = weights("int4", n, k, seed=n + k, offset=offset)
    g = torch.Generator().manual_seed(k)
    for rows in (*range(1, 10), 16, 21):
        check(torch.randn(rows, k, generator=g).to(dtype), q, s, deq, codes)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_inputs_near_their_blocks_largest_are_exact_and_nan_or_inf_stay_in_their_row(scheme):
    n, k = 13, 320
    q, s, deq, _ = weights(scheme, n, k, seed=5)
    g = torch.Generator().manual_seed(6)
    # Integers of -127..127 and inputs within 2^7 of a block's largest are exact (times a power of two): only the
    # fp32 sums differ.
    x = torch.randint(-127, 128, (5, k), generator=g).float()
    x[:, ::BLOCK] = 127
    x[1] *= 2.0**-20
    out = path(x, q, s, "int_dot")
    ref = F.linear(x.double(), deq.double())
    assert torch.all((out.double() - ref).abs() <= 1e-6 * (x.abs() @ deq.abs().T))
    x[2, 40] = float("nan")
    x[1, 7] = float("inf")
    x[3] = 0
    out = path(x, q, s, "int_dot")
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all() and torch.equal(out[3], torch.zeros(n))
    assert torch.equal(out[[0, 4]], path(x[[0, 4]], q, s, "int_dot"))  # rows are independent


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_linear_takes_the_int_dot_path_to_its_largest_row_count_then_the_widened_one(scheme):
    op = torch.ops.vllm_neuron.linear_int8 if scheme == "int8" else torch.ops.vllm_neuron.linear_int4
    q, s, _, _ = weights(scheme, 10, 128, seed=7)
    g = torch.Generator().manual_seed(8)
    for rows, name in ((1, "int_dot"), (5, "int_dot"), (INT_DOT_ROWS, "int_dot"), (INT_DOT_ROWS + 1, "widened")):
        x = torch.randn(rows, 128, generator=g)
        assert torch.equal(op(x, q, s), path(x, q, s, name)), rows
    assert not torch.equal(path(x, q, s, "int_dot"), path(x, q, s, "widened"))  # the two paths are told apart
    with pytest.raises(RuntimeError, match="path must be 'int_dot' or 'widened'"):
        path(x, q, s, "fp32")
