"""MXFP4 packing: our dequantization equals transformers' (gpt-oss's reference), quantization round-trips
within FP4 precision, and gpt-oss expert tensors load in either form."""
from __future__ import annotations

import pytest
import torch

from vllm_neuron.model.gpt_oss.weights import expert_tensors
from vllm_neuron.model.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4


def test_dequantize_equals_transformers_reference():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 64, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 134, (3, 64, 2), generator=g, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), ref.transpose(1, 2))


def test_quantize_round_trip_error_is_within_fp4_precision():
    w = torch.randn(4, 8, 96)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (4, 8, 3, 16) and scales.shape == (4, 8, 3) and blocks.dtype == torch.uint8
    back = dequantize_mxfp4(blocks, scales, torch.float32)
    # The scale s puts the group's max in (3s, 6s]; the widest FP4 gap (4 -> 6) rounds by at most s.
    group_max = w.reshape(4, 8, 3, 32).abs().amax(-1, keepdim=True)
    assert ((back - w).reshape(4, 8, 3, 32).abs() <= group_max / 3 + 1e-6).all()
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(back), torch.float32), back)  # representable: exact
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(4, 31))


def test_expert_tensors_dequantize_or_keep_packed():
    w = torch.randn(2, 64, 32)  # [E, out, in] as checkpoints pack it
    blocks, scales = quantize_mxfp4(w)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    stream = [(name + "_blocks", blocks), ("model.norm.weight", torch.ones(3)), (name + "_scales", scales)]
    out = dict(expert_tensors(stream, packed=False, dtype=torch.float32))
    assert torch.equal(out[name], dequantize_mxfp4(blocks, scales, torch.float32)) and "model.norm.weight" in out
    kept = dict(expert_tensors(stream, packed=True, dtype=torch.float32))
    assert kept[name + "_blocks"] is blocks and kept[name + "_scales"] is scales
    # Unquantized (transformers' [E, in, out]) tensors are transposed, or quantized when packed.
    plain = dict(expert_tensors([(name, w.transpose(1, 2))], packed=True, dtype=torch.float32))
    assert torch.equal(plain[name + "_blocks"], blocks)
    with pytest.raises(ValueError, match="gate_up_proj_blocks' has no matching 'model.layers.0.mlp.experts.gate_up_proj_scales'"):
        list(expert_tensors(stream[:2], packed=False, dtype=torch.float32))
