"""FP8 KV cache pieces: quantize/dequantize with the clamp, the kernel over FP8 caches against torch on
the dequantized cache, the torch attention paths, checkpoint scale names, and the options' refusals."""
from __future__ import annotations

import pytest
import torch

from tests.unit.test_kernels import _reference
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.model.layers.kernels import build, ops
from vllm_neuron.model.layers.kernels import cpu_caps as caps
from vllm_neuron.model.layers import kv_quant
from vllm_neuron.model.layers.attention import AttentionMetadata, decode_mask, paged_attention, prefill_mask
from vllm_neuron.model.llama.weight_loaders import kv_scale_target

CPU = torch.device("cpu")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", FP8)
def test_quantize_clamps_to_the_formats_range_and_round_trips_the_grid(dtype):
    scale = torch.tensor(0.5)
    limit = torch.finfo(dtype).max
    x = torch.tensor([0.0, 1.0, -3.0, 1e9, -1e9])
    q = kv_quant.quantize(x, scale, dtype)
    assert q.dtype == dtype
    back = kv_quant.dequantize(q, scale, torch.float32)
    assert torch.equal(back, torch.tensor([0.0, 1.0, -3.0, limit * 0.5, -limit * 0.5]))  # no inf, no NaN
    assert torch.equal(kv_quant.quantize(back, scale, dtype).view(torch.uint8), q.view(torch.uint8))


def test_kv_dtype_names():
    assert kv_quant.kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_quant.kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_quant.kv_cache_torch_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_quant.kv_cache_torch_dtype("fp8_e5m2", torch.float32) == torch.float8_e5m2
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert EngineArgs.from_kwargs(kv_cache_dtype=name).kv_cache_dtype == name


def _caches(g, slots, kv, d, dtype, k_scale, v_scale):
    k = torch.randn(slots, kv, d, generator=g) * 4
    v = torch.randn(slots, kv, d, generator=g)
    return kv_quant.quantize(k, k_scale, dtype), kv_quant.quantize(v, v_scale, dtype)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_over_fp8_caches_equals_torch_on_the_dequantized_cache(cache_dtype, dtype, tol):
    assert caps.kernels_enabled(CPU)
    g = torch.Generator().manual_seed(3)
    heads, kv, d, bs, nblocks = 9, 3, 64, 16, 40
    k_scale, v_scale = torch.tensor(0.37), torch.tensor(1.9)
    kc, vc = _caches(g, nblocks * bs, kv, d, cache_dtype, k_scale, v_scale)
    kd, vd = kv_quant.dequantize(kc, k_scale, torch.float32), kv_quant.dequantize(vc, v_scale, torch.float32)
    tables = torch.randperm(nblocks - 1, generator=g)[:30].add(1).view(3, 10)
    # Prefill rows (70 cached tokens + 5 new; 40 new from 0; 3 padding rows), then decode rows.
    cases = [(torch.tensor([0, 5, 45, 45]), torch.cat([torch.arange(70, 75), torch.arange(40),
                                                         torch.zeros(3, dtype=torch.long)])),
             (torch.arange(4), torch.tensor([0, 31, 159]))]
    for starts, positions in cases:
        q = torch.randn(positions.shape[0], heads, d, generator=g).to(dtype)
        out = ops.paged_attention_fp8(q, kc, vc, tables, starts, positions, 0.125, bs, k_scale, v_scale)
        assert out.dtype == dtype
        ref = _reference(q, kd, vd, tables, starts, positions, 0.125, bs)
        rows = int(starts[-1])
        torch.testing.assert_close(out[:rows].float(), ref[:rows], atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", FP8)
def test_torch_paths_write_quantized_and_read_dequantized(cache_dtype):
    g = torch.Generator().manual_seed(5)
    heads, kv, d, bs = 4, 2, 16, 4
    k_scale, v_scale = torch.tensor(0.5), torch.tensor(2.0)
    kc = torch.zeros(16 * bs, kv, d, dtype=cache_dtype)
    vc = torch.zeros(16 * bs, kv, d, dtype=cache_dtype)
    # Prefill of 6 tokens of one sequence into blocks 1-2, then decode of its 7th token.
    q, k, v = (torch.randn(6, n, d, generator=g) for n in (heads, kv, kv))
    slots = torch.arange(4, 10)
    positions = torch.arange(6)
    meta = AttentionMetadata(slots, prefill_mask(positions, torch.zeros(6, dtype=torch.long), None))
    out = paged_attention(q, k, v, kc, vc, meta, 0.25, k_scale=k_scale, v_scale=v_scale)
    kq = kv_quant.dequantize(kv_quant.quantize(k, k_scale, cache_dtype), k_scale, torch.float32)
    vq = kv_quant.dequantize(kv_quant.quantize(v, v_scale, cache_dtype), v_scale, torch.float32)
    assert torch.equal(kv_quant.dequantize(kc[slots], k_scale, torch.float32), kq)
    tables = torch.tensor([[1, 2]])
    ref = _reference(q, torch.zeros(12, kv, d).index_copy(0, slots, kq),
                     torch.zeros(12, kv, d).index_copy(0, slots, vq), tables, torch.tensor([0, 6]), positions, 0.25, bs)
    torch.testing.assert_close(out, ref.reshape(6, -1), rtol=1e-5, atol=1e-5)
    q1, k1, v1 = (torch.randn(1, n, d, generator=g) for n in (heads, kv, kv))
    meta = AttentionMetadata(torch.tensor([10]), decode_mask(torch.tensor([7]), 8), block_tables=tables, is_decode=True)
    out = paged_attention(q1, k1, v1, kc, vc, meta, 0.25, k_scale=k_scale, v_scale=v_scale)
    kd, vd = kv_quant.dequantize(kc, k_scale, torch.float32), kv_quant.dequantize(vc, v_scale, torch.float32)
    ref = _reference(q1, kd, vd, tables, torch.tensor([0, 1]), torch.tensor([6]), 0.25, bs)
    torch.testing.assert_close(out, ref.reshape(1, -1), rtol=1e-5, atol=1e-5)


def test_checkpoint_scale_names():
    parts = "model.layers.3.self_attn.k_proj.k_scale".split(".")  # ModelOpt
    name, index, fn = kv_scale_target(parts)
    assert name == "model.layers.3.self_attn.k_scale" and index is None and fn(torch.ones(1)).shape == ()
    assert kv_scale_target("model.layers.0.self_attn.v_scale".split("."))[0] == "model.layers.0.self_attn.v_scale"
    assert kv_scale_target("model.layers.0.self_attn.q_scale".split(".")) is None
