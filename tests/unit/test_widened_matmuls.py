"""KernelConfig.widen_bf16 (the AVX2 class) beyond the decoder's Linear: the MoE experts and the encoders' linears
run bf16 matmuls in fp32 on weights widened per call, rounding the result once, and take the bf16 matmul where
the CPU has one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vllm_neuron.model.layers.kernel_config import KernelConfig, apply_kernel_config
from vllm_neuron.model.layers.linear import EncoderLinear
from vllm_neuron.model.layers.moe import StackedExperts

WIDEN = KernelConfig(widen_bf16=True)


def test_encoder_linear_widens_bf16_and_takes_the_engines_config(monkeypatch):
    seen = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: seen.append((x.dtype, w.dtype, b.dtype)) or linear(x, w, b))
    layer = EncoderLinear(64, 48, bias=True).bfloat16()
    x = torch.randn(37, 64).bfloat16()
    assert apply_kernel_config(nn.Sequential(layer), WIDEN) == 1
    out = layer(x)
    assert seen == [(torch.float32,) * 3] and out.dtype == torch.bfloat16
    assert torch.equal(out, linear(x.float(), layer.weight.float(), layer.bias.float()).bfloat16())
    seen.clear()
    layer.kernels = KernelConfig()  # bf16 matmul hardware (or no engine): nn.Linear as it is
    assert torch.equal(layer(x), linear(x, layer.weight, layer.bias)) and seen == [(torch.bfloat16,) * 3]
    seen.clear()
    layer.kernels = WIDEN
    layer.float()(x.float())  # fp32 is left alone
    assert seen == [(torch.float32,) * 3]


def _experts(bias: bool) -> StackedExperts:
    torch.manual_seed(0)
    e = StackedExperts(8, 32, 24, bias=bias)
    for p in e.parameters():
        nn.init.normal_(p, std=0.2)
    return e


@pytest.mark.parametrize("bias", [False, True])
def test_dense_experts_widen_bf16_and_round_once(monkeypatch, bias):
    """The dense path (prefill-sized) widens; the gathered path (decode-sized: matrix-vector products over the
    gathered experts' weights) keeps bf16, whose products stream half the bytes."""
    seen = []
    for name in ("bmm", "einsum"):
        fn = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _fn=fn, _n=name: seen.append(
            (_n, [t.dtype for t in a if isinstance(t, torch.Tensor)])) or _fn(*a))
    experts = _experts(bias).bfloat16()
    reference = _experts(bias).bfloat16().float()  # the same bf16 values, multiplied in fp32
    for tokens, path in ((16, "einsum"), (2, "bmm")):  # 2 tokens x top-2 <= 8 experts: gathered
        x = torch.randn(tokens, 32).bfloat16()
        weights, ids = torch.softmax(torch.randn(tokens, 2), -1).bfloat16(), torch.randint(0, 8, (tokens, 2))
        expected = reference(x.float(), weights, ids).bfloat16()
        seen.clear()
        experts.kernels = WIDEN
        out = experts(x, weights, ids)
        assert out.dtype == torch.bfloat16 and seen and {n for n, _ in seen} == {path}
        if path == "einsum":
            assert torch.equal(out, expected)
            assert all(dt == torch.float32 for _, call in seen for dt in call)
        else:
            assert all(call[:2] == [torch.bfloat16] * 2 for _, call in seen)
        seen.clear()
        experts.kernels = KernelConfig()  # bf16 matmul hardware: bf16 throughout
        assert experts(x, weights, ids).dtype == torch.bfloat16
        assert all(dt == torch.bfloat16 for _, call in seen for dt in call[:2])
