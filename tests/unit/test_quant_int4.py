"""Weight-only int4: quantization, the two matmul paths, in-place layer quantization, and where the
option is refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_neuron.config.device import check_int4_support
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.model.layers.linear import Linear, quantize_linears_int4_
from vllm_neuron.model.layers.quant_int4 import (INT4_GROUP_SIZE, INT4_KERNEL_ROWS,
                                                 dequantize_int4, int4_linear, quantize_int4)


def _weight(n: int = 48, k: int = 96, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_error_is_at_most_half_a_step_per_group():
    w = _weight()
    _, nibbles, sz = quantize_int4(w, torch.float32)
    deq = dequantize_int4(nibbles, sz, torch.float32)
    groups = w.reshape(w.shape[0], -1, INT4_GROUP_SIZE)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    err = (deq - w).abs().reshape_as(groups).amax(-1)
    assert torch.all(err <= step / 2 + 1e-6)
    assert deq.shape == w.shape and not torch.equal(deq, w)


def test_weights_on_a_4bit_grid_come_back_exactly():
    # What a Q4_1 GGUF holds: w = d * q + m per block of 32, every code 0..15 used in every block.
    n, k = 16, 64
    gen = torch.Generator().manual_seed(1)
    q = torch.stack([torch.randperm(INT4_GROUP_SIZE, generator=gen) % 16 for _ in range(n * k // 32)])
    d = torch.rand(n * k // 32, 1, generator=gen) * 0.25 + 0.125  # powers-of-two-friendly scales
    d = torch.round(d * 64) / 64
    m = torch.round(torch.randn(n * k // 32, 1, generator=gen) * 64) / 64
    w = (q.float() * d + m).reshape(n, k)
    _, nibbles, sz = quantize_int4(w, torch.float32)
    assert torch.equal(dequantize_int4(nibbles, sz, torch.float32), w)


@pytest.mark.parametrize("rows", [1, 7, INT4_KERNEL_ROWS, INT4_KERNEL_ROWS + 1, 64])
def test_both_matmul_paths_equal_the_dequantized_matmul(rows):
    w = _weight()
    packed, nibbles, sz = quantize_int4(w, torch.float32)
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(w.shape[0])
    ref = F.linear(x, dequantize_int4(nibbles, sz, torch.float32), bias)
    torch.testing.assert_close(int4_linear(x, packed, nibbles, sz, bias), ref, rtol=1e-5, atol=1e-4)
    # Leading dimensions are kept.
    assert int4_linear(x[None], packed, nibbles, sz).shape == (1, rows, w.shape[0])


@pytest.mark.parametrize("rows", [4, 40])
def test_compiled_equals_eager(rows):
    w = _weight()
    packed, nibbles, sz = quantize_int4(w, torch.bfloat16)
    x = torch.randn(rows, w.shape[1]).bfloat16()
    fn = torch.compile(lambda a: int4_linear(a, packed, nibbles, sz), fullgraph=True, dynamic=False)
    torch.testing.assert_close(fn(x), int4_linear(x, packed, nibbles, sz))


def test_quantize_in_place_keeps_a_tied_weight_with_its_other_owner():
    emb = torch.nn.Embedding(64, 32)
    model = torch.nn.Module()
    model.embed, model.proj, model.head = emb, Linear(32, 96, bias=True), Linear(32, 64, bias=False)
    model.head.weight = emb.weight
    before_emb = emb.weight.detach().clone()
    x = torch.randn(3, 32)
    ref = F.linear(x, model.proj.weight, model.proj.bias)
    layers, before, after = quantize_linears_int4_(model)
    assert layers == 2 and before == (96 * 32 + 64 * 32) * 4 and after < before / 2
    assert torch.equal(emb.weight, before_emb) and "weight" not in dict(model.head.named_parameters())
    assert not any(isinstance(p, torch.nn.Parameter) and p.dim() == 2 and p.shape == (96, 32)
                   for p in model.parameters())
    torch.testing.assert_close(model.proj(x), ref, rtol=0.1, atol=0.2)  # quantization error only


def test_refused_off_cpu_and_for_other_schemes():
    with pytest.raises(ValueError, match="CPU device only"):
        check_int4_support(torch.float32, torch.device("cuda"))
    with pytest.raises(ValueError, match="dtype"):
        check_int4_support(torch.int8, torch.device("cpu"))
    with pytest.raises(ValueError, match="in_features divisible by 32"):
        quantize_int4(torch.randn(16, 48), torch.float32)
    with pytest.raises(ValueError, match="out_features divisible by 16"):
        quantize_int4(torch.randn(8, 64), torch.float32)
    with pytest.raises(ValueError, match="quantization='int8'.*not supported yet.*int4"):
        EngineConfig(additional_config={"neuron_config": {"quantization": "int8"}}).validate_static()
    EngineConfig(device="cpu", additional_config={"neuron_config": {"quantization": "int4"}}).validate_static()
