"""The AVX512-VNNI build's int4 decode linear for one bf16 row (kernels/int4_vnni.h: VPDPWSSD on the input made
int16 as kernels/int_dot.h states) against the dequantized matmul, within that input rounding, at every band
tail and a short last input block; and that such a row takes it, and fp32 rows and more bf16 rows do not."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.test_int_dot_avx2 import int_dot_bound, weights
from vllm_neuron.model.layers import quant_int4 as Q4
from vllm_neuron.model.layers.kernels import cpu_caps as caps

pytestmark = pytest.mark.skipif(
    not (caps.kernels_enabled(torch.device("cpu")) and caps.kernel_variant()[0] == "avx512bf16"
         and "avx512_vnni" in caps.cpu_flags()),
    reason="the int4 integer-dot path of one row is in AVX512-VNNI builds only")


def linear_int4(x, q, s):
    return torch.ops.vllm_neuron.linear_int4(x, q, s)


@pytest.mark.parametrize("n, k", [(960, 576), (7, 64), (9, 192), (190, 1536), (2, 128)])
@pytest.mark.parametrize("offset", [0.0, 3.0])
def test_one_bf16_row_within_the_input_rounding(n, k, offset):
    """The bound counts only q * scale: the groups' minimums (large with the offset) meet the inputs' exact sums."""
    q, s, deq, codes = weights("int4", n, k, seed=n + k, offset=offset)
    g = torch.Generator().manual_seed(k)
    for seed in range(3):
        x = torch.randn(1, k, generator=g).bfloat16() * (1 + seed)
        out = linear_int4(x, q, s)
        ref = F.linear(x.double(), deq.double()).float()
        assert out.dtype == torch.bfloat16 and out.shape == ref.shape
        bound = int_dot_bound(x, codes)
        slack = (x.float().abs() @ deq.abs().T) * 2e-6 + (ref.abs() + bound) * 2**-8  # fp32 sums; bf16 output
        excess = (out.float() - ref).abs() - bound - slack
        assert excess.max().item() <= 0, (seed, n, k, excess.max().item())


def test_a_row_that_takes_it_rounds_small_inputs_to_their_blocks_step():
    """One input of 1.0 and the rest of its block 1e-6: made int16 (a step of 2^-14 of the block) those round to 0
    against the codes, while their exact sum still meets the minimums; the widening path keeps them."""
    n, k = 8, 256
    w = 0.5 + 0.5 * torch.rand(n, k, generator=torch.Generator().manual_seed(3))
    w[:, 0] = 0.0  # group 0's minimum: its code and dequantized weight are 0, so the 1.0 adds nothing
    q, s = Q4.quantize(w)
    deq = Q4.dequantize(q, s, torch.float32)
    mins_only = Q4.dequantize(torch.zeros_like(q), s, torch.float32)  # each weight's group minimum
    x = torch.full((1, k), 1e-6).bfloat16()
    x[0, 0] = 1.0
    exact = F.linear(x.double(), deq.double()).float()
    rounded = F.linear(x.double(), mins_only.double()).float()  # the codes' products with 1e-6 rounded away
    for rows_x, dtype_path in ((x, "int16"), (x.float(), "widened"), (x.repeat(2, 1), "widened"),
                               (x.repeat(5, 1), "bf16 bands")):
        out = linear_int4(rows_x, q, s)[:1].float()
        if dtype_path == "int16":
            torch.testing.assert_close(out, rounded, rtol=2**-7, atol=0)
            assert ((out - exact).abs() > 0.1 * exact.abs()).all()
        else:  # an fp32 row and two or five bf16 rows keep their other paths
            torch.testing.assert_close(out, exact, rtol=2**-7, atol=0)


def test_a_nan_input_makes_every_output_nan():
    q, s, _, _ = weights("int4", 13, 320, seed=5)
    x = torch.randn(1, 320, generator=torch.Generator().manual_seed(6)).bfloat16()
    x[0, 300] = float("nan")
    assert linear_int4(x, q, s).float().isnan().all()
