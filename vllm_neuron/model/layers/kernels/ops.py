"""The custom CPU kernels as torch ops: Python wrappers with their shapes documented, the fake
implementations that let torch.compile keep each op as one call inside a bucket's graph, and the
tile order the tile-order linears read."""
from __future__ import annotations

import torch

from vllm_neuron import huge_pages


def has_op(name: str) -> bool:
    """Whether the loaded build defines `torch.ops.vllm_neuron.<name>`."""
    try:
        getattr(torch.ops.vllm_neuron, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def linear_fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def register_fakes() -> None:
    """Fake implementations of the ops the loaded build defines (called once, right after loading it)."""
    @torch.library.register_fake("vllm_neuron::paged_attention")
    def _(q, k_cache, v_cache, block_tables, query_start, positions, scale, block_size, sinks=None, window=0):
        return torch.empty_like(q)

    @torch.library.register_fake("vllm_neuron::paged_attention_fp8")
    def _(q, k_cache, v_cache, block_tables, query_start, positions, scale, block_size, k_scale, v_scale, sinks=None,
          window=0):
        return torch.empty_like(q)

    for op in ("linear_bf16", "linear_f32", "linear_tiles"):
        if has_op(op):
            torch.library.register_fake(f"vllm_neuron::{op}")(linear_fake)
    for name in ("linear_amx", "linear_dot_tiles"):
        if has_op(name):
            torch.library.register_fake(f"vllm_neuron::{name}")(lambda x, packed, bias, n: x.new_empty((x.shape[0], n)))
    for name in ("linear_int8", "linear_int4"):
        if has_op(name):
            torch.library.register_fake(f"vllm_neuron::{name}")(lambda x, q, scale: x.new_empty((x.shape[0], q.shape[0])))
    if has_op("linear_int4_tiles"):
        torch.library.register_fake("vllm_neuron::linear_int4_tiles")(
            lambda x, codes, scales, bias: x.new_empty((x.shape[0], codes.shape[0])))
        torch.library.register_fake("vllm_neuron::linear_int8_tiles")(
            lambda x, codes, corr, scale, bias: x.new_empty((x.shape[0], codes.shape[0])))
    if has_op("greedy_argmax"):
        torch.library.register_fake("vllm_neuron::apply_token_bitmask_")(lambda logits, bitmask: None)
        torch.library.register_fake("vllm_neuron::greedy_argmax")(
            lambda logits: logits.new_empty((logits.shape[0],), dtype=torch.long))
        torch.library.register_fake("vllm_neuron::sample_rows")(
            lambda logits, temperature, top_k, top_p, uniform, max_top_k, width:
            logits.new_empty((logits.shape[0],), dtype=torch.long))
        torch.library.register_fake("vllm_neuron::sample_slots")(
            lambda logits, slots, positions, temperature, top_k, top_p, seed, max_top_k, width:
            logits.new_empty((logits.shape[0],), dtype=torch.long))
        torch.library.register_fake("vllm_neuron::store_token_state_")(
            lambda last_token, position, slots, tokens, next_pos: None)
    if has_op("lora_delta"):
        torch.library.register_fake("vllm_neuron::lora_delta")(
            lambda x, slot, a, b_t: x.new_empty((x.shape[0], b_t.shape[2])))
    if has_op("silu_and_mul"):
        torch.library.register_fake("vllm_neuron::silu_and_mul")(
            lambda h: h.new_empty((*h.shape[:-1], h.shape[-1] // 2)))
    if has_op("unpack_int8"):
        torch.library.register_fake("vllm_neuron::unpack_int8")(lambda q, dtype: q.new_empty(q.shape, dtype=dtype))
        torch.library.register_fake("vllm_neuron::unpack_int4")(
            lambda q, scales, dtype: q.new_empty((q.shape[0], 2 * q.shape[1]), dtype=dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start: torch.Tensor, positions: torch.Tensor, scale: float, block_size: int,
                    sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of every query row over its sequence's cached keys 0..position.

    q [N, H, D]; caches [slots, KV, D] (the rows' own K/V already written); block_tables [S, n];
    query_start [S + 1] (rows of sequence s: query_start[s]..query_start[s + 1]); positions [N].
    sinks [H]: one logit per query head joining the softmax (gpt-oss); window: a row sees only keys
    position - window + 1 .. position (the rest of the table may be null blocks).
    Returns [N, H, D]; rows of no sequence (padding) are 0."""
    return torch.ops.vllm_neuron.paged_attention(q, k_cache, v_cache, block_tables, query_start, positions,
                                                 scale, block_size, sinks, window or 0)


def paged_attention_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start: torch.Tensor, positions: torch.Tensor, scale: float, block_size: int,
                        k_scale: torch.Tensor, v_scale: torch.Tensor, sinks: torch.Tensor | None = None,
                        window: int | None = None) -> torch.Tensor:
    """`paged_attention` over FP8 caches (float8_e4m3fn / float8_e5m2) holding K / k_scale and V / v_scale;
    q and the result in the compute dtype."""
    return torch.ops.vllm_neuron.paged_attention_fp8(q, k_cache, v_cache, block_tables, query_start, positions,
                                                     scale, block_size, k_scale, v_scale, sinks, window or 0)


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q [N, K] int8 * scale [N])^T -> [M, N] in x's dtype, K a multiple of 16; for small M.
    q in quant_int8's band layout."""
    return torch.ops.vllm_neuron.linear_int8(x, q, scale)


def linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T, W in quant_int4's packed band layout ([N, K / 2] uint8, [N, K / 32, 2] fp32) -> [M, N]."""
    return torch.ops.vllm_neuron.linear_int4(x, packed, scales)


def linear_int4_tiles(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp32) @ W^T (+ bias, fp32 [N]) -> [M, N] in x's dtype, W in quant_int4's tile order
    (`to_tiles`), the activations made int8 per row and group of 32 (kernels/linear_int4_tiles.cpp)."""
    return torch.ops.vllm_neuron.linear_int4_tiles(x, codes, scales, bias)


def linear_int8_tiles(x: torch.Tensor, codes: torch.Tensor, corr: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp32) @ (q * scale)^T (+ bias, fp32 [N]) -> [M, N] in x's dtype, q in quant_int8's tile
    order with its group corrections (`to_tiles`), the activations made int8 per row and group of 32
    (kernels/linear_int8_tiles.cpp)."""
    return torch.ops.vllm_neuron.linear_int8_tiles(x, codes, corr, scale, bias)


def unpack_int8(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quant_int8's band-layout q -> the row-major [N, K] q in `dtype` (exact)."""
    return torch.ops.vllm_neuron.unpack_int8(q, dtype)


def unpack_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quant_int4's packed band layout -> the row-major [N, K] weight in `dtype` (q * scale + min in fp32)."""
    return torch.ops.vllm_neuron.unpack_int4(packed, scales, dtype)


def linear_small_batch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype (bf16 or fp32), K a multiple of 32; for small M (decode)."""
    if x.dtype == torch.bfloat16:
        return torch.ops.vllm_neuron.linear_bf16(x, w)
    return torch.ops.vllm_neuron.linear_f32(x, w)


def lora_delta(x: torch.Tensor, slot: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """x [n, in] -> [n, out]: each row shrunk by a[slot[row]] [W, in] and expanded by b_t[slot[row]] [W, out]
    (slot 0: zeros) in one op (kernels/lora.cpp), bf16 or fp32."""
    return torch.ops.vllm_neuron.lora_delta(x, slot, a, b_t)


def pack_tiles(w: torch.Tensor, place=huge_pages.copy) -> torch.Tensor:
    """w [N, K] in the tile kernels' order: one B tile per 16 columns x 32 inputs, [N/16][K/32][16][16][2],
    copied by `place` (a strided tensor -> a contiguous copy: huge_pages.copy, or an Arena's place)."""
    n, k = w.shape
    return place(w.view(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)).contiguous()
