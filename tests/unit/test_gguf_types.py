"""Every GGUF tensor type llama.cpp users download loads as the `gguf` package's own dequantization.

Types the package can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are written from a tiny model; the K-quants and
IQ4_XS/IQ4_NL, which it can only dequantize, are written as random valid blocks (tests/model_factory.py's
random_gguf_blocks). The reference is read with a fresh GGUFReader and `gguf.quants.dequantize`, never through
our loader.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from tests.model_factory import make_tiny_gguf
from vllm_neuron.model.loader import load_checkpoint
from vllm_neuron.model.loader.gguf_loader import hf_tensor_name

# Rows of 256: whole super-blocks of the K-quants. qwen3: no Q/K permutation to undo in the reference.
SHAPE = dict(arch="qwen3", num_hidden_layers=1, hidden_size=256, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=512, tokenizer=False, seed=3)
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
QUANT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL"]


def _reference(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(HF name -> gguf's dequantized float32 tensor, HF name -> the file's type name)."""
    reader = gguf.GGUFReader(path)
    ref, types = {}, {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name, "qwen3")[0]
        arr = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
        ref[name] = torch.from_numpy(arr.reshape(tuple(int(d) for d in reversed(t.shape))))
        types[name] = t.tensor_type.name
    return ref, types


@pytest.mark.parametrize("qtype", [*FLOAT_TYPES, *QUANT_TYPES])
def test_each_tensor_type_loads_as_gguf_dequantizes_it(tmp_path, qtype):
    kw = dict(dtype=FLOAT_TYPES[qtype]) if qtype in FLOAT_TYPES else dict(quant=qtype)
    path = make_tiny_gguf(str(tmp_path / f"{qtype}.gguf"), **kw, **SHAPE)
    ref, types = _reference(path)
    matrices = {n for n, t in ref.items() if t.ndim == 2}
    assert len(matrices) == 9 and {types[n] for n in matrices} == {qtype}  # the file really holds the type
    got = dict(load_checkpoint(path).iter_weights(torch.float32))
    assert set(got) == set(ref)
    for name, want in ref.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want), name
    # Not all zero or constant: random blocks decode to real weights.
    assert all(ref[n].std() > 1e-3 and torch.isfinite(ref[n]).all() for n in matrices)
