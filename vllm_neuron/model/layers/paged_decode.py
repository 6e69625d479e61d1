"""Decode attention over each sequence's real context, read through its block table.

The torch decode path (attention.py) gathers the whole context bucket and masks it, so a 40-token
sequence in a 1024-token bucket pays for 1024. On CUDA a Triton kernel
(kernels/triton_paged_decode.py) instead walks each sequence's block table only up to its length,
one program per (sequence, KV head), with an online softmax over KV blocks; it is registered as the
custom op `vllm_neuron::paged_decode` so a compiled bucket graph keeps it as one call (and a CUDA graph
captures it like any kernel).

`paged_decode_reference` is the same algorithm in torch (block by block, online softmax), used where
the kernel cannot run: it is what CPU tests check against the SDPA path, and the op's implementation
off CUDA.
"""
from __future__ import annotations

import functools

import torch

from vllm_neuron import envs
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)


def paged_decode_reference(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_slots, KV, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, NBLK]
    seq_lens: torch.Tensor,  # [B] keys visible to each sequence (the new token included)
    scale: float,
    block_size: int,
) -> torch.Tensor:
    """[B, H, D]: the kernel's algorithm in torch. Block column j of every sequence is read and
    folded into a running (max, sum, accumulator) per query head; keys at or beyond a sequence's
    length are masked. Computed in fp32."""
    b, h, d = q.shape
    kv = k_cache.shape[1]
    g = h // kv
    qf = q.float().view(b, kv, g, d)
    m = torch.full((b, kv, g), float("-inf"), device=q.device)
    l = torch.zeros((b, kv, g), device=q.device)
    acc = torch.zeros((b, kv, g, d), device=q.device)
    offs = torch.arange(block_size, device=q.device)
    for j in range(block_tables.shape[1]):
        slots = block_tables[:, j, None] * block_size + offs  # [B, BS]
        valid = (j * block_size + offs)[None, :] < seq_lens[:, None]  # [B, BS]
        # Keys past a sequence's length count for nothing, whatever the slots hold (the kernel never loads them).
        hide = ~valid[:, None, :, None]
        k = k_cache[slots].float().permute(0, 2, 1, 3).masked_fill(hide, 0.0)  # [B, KV, BS, D]
        v = v_cache[slots].float().permute(0, 2, 1, 3).masked_fill(hide, 0.0)
        s = torch.einsum("bkgd,bktd->bkgt", qf, k) * scale
        s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        # A block with no visible key for a row (m_new still -inf) must add nothing, not NaN.
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bkgt,bktd->bkgd", p, v)
        m = m_new
    out = acc / torch.where(l == 0, torch.ones_like(l), l)[..., None]
    return out.view(b, h, d).to(q.dtype)


@torch.library.custom_op("vllm_neuron::paged_decode", mutates_args=())
def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """[B, H, D] attention of one decode query per sequence over its first seq_lens[b] keys."""
    if q.is_cuda:
        from vllm_neuron.model.layers.kernels.triton_paged_decode import paged_decode_triton

        return paged_decode_triton(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size)
    return paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size)


@paged_decode.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size):
    return torch.empty_like(q)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@functools.lru_cache(maxsize=None)
def paged_decode_available(device_type: str, head_dim: int, block_size: int) -> bool:
    """Whether decode attention takes the Triton kernel: a CUDA device with triton installed, custom
    kernels not disabled, and power-of-two head_dim and block_size (the kernel's tile shapes)."""
    if device_type != "cuda" or envs.VLLM_NEURON_DISABLE_NKI_KERNELS:
        return False
    if not (_pow2(head_dim) and _pow2(block_size)):
        logger.info("Paged decode kernel off: head_dim=%d and block_size=%d must be powers of two; decode "
                    "attention covers the whole context bucket", head_dim, block_size)
        return False
    try:
        _smoke_test(head_dim, block_size)
    except Exception as e:  # noqa: BLE001 - no triton, or a kernel this GPU/triton cannot build
        logger.warning("Paged decode kernel off (%s: %s); decode attention covers the whole context bucket",
                       type(e).__name__, e)
        return False
    return True


def _smoke_test(head_dim: int, block_size: int) -> None:
    """Builds and runs the kernel once on a tiny case and checks it against the reference, so that a GPU
    or triton version it does not work on falls back at start-up instead of failing a warm-up."""
    from vllm_neuron.model.layers.kernels.triton_paged_decode import paged_decode_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(3 * block_size, 2, head_dim, device="cuda", generator=g)
    vc = torch.randn(3 * block_size, 2, head_dim, device="cuda", generator=g)
    q = torch.randn(2, 4, head_dim, device="cuda", generator=g)
    tables = torch.tensor([[1, 2], [2, 0]], device="cuda", dtype=torch.int32)
    lens = torch.tensor([block_size + 1, 1], device="cuda", dtype=torch.int32)
    args = (q, kc, vc, tables, lens, head_dim ** -0.5, block_size)
    err = (paged_decode_triton(*args) - paged_decode_reference(*args)).abs().max().item()
    if not err < 1e-3:
        raise RuntimeError(f"the kernel differs from its reference by {err}")
