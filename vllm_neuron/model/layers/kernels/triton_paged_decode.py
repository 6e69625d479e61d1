"""The Triton kernel behind `vllm_neuron::paged_decode` on CUDA (imported only there, or by tests under
TRITON_INTERPRET=1). See model/layers/paged_decode.py for the algorithm and its torch reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, o_ptr, scale,
                         stride_qb, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt,
                         stride_ob, stride_oh,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
    # One program per (sequence, KV head): the G query heads sharing the KV head read each K/V block once.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    seq_len = tl.load(len_ptr + b)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    t = tl.arange(0, BS)
    heads = kvh * G + g
    gmask = g < G
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None],
                other=0.0).to(tl.float32)
    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for j in range(0, tl.cdiv(seq_len, BS)):  # only the blocks this sequence has filled
        blk = tl.load(bt_ptr + b * stride_bt + j).to(tl.int64)
        slots = blk * BS + t
        valid = j * BS + t < seq_len
        k = tl.load(k_ptr + slots[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=valid[:, None],
                    other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [GP, BS]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + slots[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=valid[:, None],
                    other=0.0).to(tl.float32)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    l = tl.where(l == 0.0, 1.0, l)
    out = acc / l[:, None]
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=gmask[:, None])


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    b, h, d = q.shape
    kv = k_cache.shape[1]
    g = h // kv
    q = q.contiguous()
    out = torch.empty_like(q)
    _paged_decode_kernel[(b, kv)](
        q, k_cache, v_cache, block_tables, seq_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        G=g, GP=triton.next_power_of_2(g), D=d, BS=block_size)
    return out
