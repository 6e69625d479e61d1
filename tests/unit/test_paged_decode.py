"""Decode attention over each sequence's real context: the torch reference of the CUDA kernel's
algorithm against the SDPA path over the whole bucket, the op's dispatch, and the Triton kernel itself
run by Triton's CPU interpreter."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_neuron.model.layers.attention import AttentionMetadata, _decode, decode_mask, paged_attention
from vllm_neuron.model.layers.paged_decode import paged_decode, paged_decode_available, paged_decode_reference


def _case(b=4, h=8, kv=2, d=16, bs=8, nblk=6, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = (b * nblk + 1) * bs
    kc = torch.randn(slots, kv, d, generator=g).to(dtype)
    vc = torch.randn(slots, kv, d, generator=g).to(dtype)
    tables = (torch.randperm(b * nblk, generator=g).view(b, nblk) + 1).to(torch.int32)
    lens = torch.randint(1, nblk * bs + 1, (b,), generator=g).to(torch.int32)
    lens[0] = 1  # a padding-like row: one visible key
    lens[-1] = nblk * bs  # a full bucket
    q = torch.randn(b, h, d, generator=g).to(dtype)
    return q, kc, vc, tables, lens, d ** -0.5, bs


def _sdpa(q, kc, vc, tables, lens, scale, bs):
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), decode_mask(lens, tables.shape[1] * bs),
                             block_tables=tables.long(), is_decode=True)
    return _decode(q, kc, vc, meta, scale).view(q.shape)


@pytest.mark.parametrize("shape", [dict(), dict(h=12, kv=4), dict(h=6, kv=2), dict(h=4, kv=4, bs=16, nblk=3),
                                   dict(b=1, nblk=1)])
def test_reference_matches_sdpa_over_the_whole_bucket(shape):
    args = _case(**shape)
    torch.testing.assert_close(paged_decode_reference(*args), _sdpa(*args), atol=1e-5, rtol=1e-5)


def _poison_beyond_lengths(q, kc, vc, tables, lens, scale, bs):
    """The same case with NaN in every slot past each sequence's length."""
    kc2, vc2 = kc.clone(), vc.clone()
    for b in range(q.shape[0]):
        for pos in range(int(lens[b]), tables.shape[1] * bs):
            slot = int(tables[b, pos // bs]) * bs + pos % bs
            kc2[slot] = float("nan")
            vc2[slot] = float("nan")
    return q, kc2, vc2, tables, lens, scale, bs


def test_keys_beyond_each_length_count_for_nothing():
    args = _case()
    assert torch.equal(paged_decode_reference(*_poison_beyond_lengths(*args)), paged_decode_reference(*args))


def test_op_off_cuda_is_the_reference_and_compiles():
    args = _case()
    torch.testing.assert_close(paged_decode(*args), paged_decode_reference(*args))
    compiled = torch.compile(lambda *a: paged_decode(*a) * 2, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(*args), paged_decode_reference(*args) * 2)


def test_bf16_close_to_fp32():
    args = _case(dtype=torch.bfloat16)
    ref = paged_decode_reference(*[a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                   for a in args])
    torch.testing.assert_close(paged_decode_reference(*args).float(), ref, atol=3e-2, rtol=3e-2)


def test_paged_attention_takes_the_paged_decode_path():
    q, kc, vc, tables, lens, scale, bs = _case(b=2, nblk=3)
    n, kv, d = q.shape[0], kc.shape[1], kc.shape[2]
    k_new, v_new = torch.randn(n, kv, d), torch.randn(n, kv, d)
    positions = (lens - 1).long()
    slot_mapping = tables.long()[torch.arange(n), positions // bs] * bs + positions % bs
    paged = AttentionMetadata(slot_mapping, block_tables=tables, positions=positions, is_decode=True,
                              block_size=bs, paged_decode=True)
    out = paged_attention(q, k_new, v_new, kc.clone(), vc.clone(), paged, scale)
    masked = AttentionMetadata(slot_mapping, decode_mask(lens, tables.shape[1] * bs), block_tables=tables.long(),
                               is_decode=True)
    torch.testing.assert_close(out, paged_attention(q, k_new, v_new, kc.clone(), vc.clone(), masked, scale),
                               atol=1e-5, rtol=1e-5)


def test_available_only_on_cuda_with_power_of_two_tiles_and_a_working_kernel(monkeypatch, caplog):
    from vllm_neuron.model.layers import paged_decode as P

    monkeypatch.delenv("VLLM_NEURON_DISABLE_NKI_KERNELS", raising=False)
    monkeypatch.setattr(P, "_smoke_test", lambda head_dim, block_size: None)  # the kernel runs on this "GPU"
    paged_decode_available.cache_clear()
    assert not paged_decode_available("cpu", 64, 32)
    assert not paged_decode_available("cuda", 96, 32)  # head_dim not a power of two
    assert not paged_decode_available("cuda", 64, 24)
    assert paged_decode_available("cuda", 64, 32)
    monkeypatch.setenv("VLLM_NEURON_DISABLE_NKI_KERNELS", "1")
    paged_decode_available.cache_clear()
    assert not paged_decode_available("cuda", 64, 32)
    monkeypatch.delenv("VLLM_NEURON_DISABLE_NKI_KERNELS")

    def broken(head_dim, block_size):
        raise RuntimeError("the kernel differs from its reference by nan")

    monkeypatch.setattr(P, "_smoke_test", broken)
    paged_decode_available.cache_clear()
    assert not paged_decode_available("cuda", 64, 32)
    assert "Paged decode kernel off (RuntimeError: the kernel differs" in caplog.text
    paged_decode_available.cache_clear()


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_INTERPRETED = """
import torch
from tests.unit.test_paged_decode import _case, _poison_beyond_lengths, _sdpa
from vllm_neuron.model.layers.kernels.triton_paged_decode import paged_decode_triton
from vllm_neuron.model.layers.paged_decode import paged_decode_reference
worst = 0.0
for shape in (dict(), dict(h=12, kv=4), dict(h=6, kv=2, seed=3), dict(b=1, nblk=1)):
    args = _case(**shape)
    out = paged_decode_triton(*args)
    worst = max(worst, (out - paged_decode_reference(*args)).abs().max().item(),
                (out - _sdpa(*args)).abs().max().item())
    assert torch.equal(paged_decode_triton(*_poison_beyond_lengths(*args)), out)  # never loaded
print("WORST", worst)
"""


@pytest.mark.skipif(not _has_triton(), reason="triton is not installed")
def test_triton_kernel_in_the_interpreter_matches_the_reference():
    """The CUDA kernel's own code, run on CPU by TRITON_INTERPRET=1 (set before triton defines the kernel,
    hence a child process)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED], capture_output=True, text=True, timeout=300,
                          env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    worst = float(proc.stdout.split("WORST")[1])
    assert worst < 1e-5, proc.stdout
