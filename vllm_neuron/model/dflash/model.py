"""The DFlash draft on the paged KV cache: Qwen3-style layers (per-head q/k RMSNorm) with one K/V cache
layer each, on the target's blocks and slots.

* `write_context`: the target's tapped hidden states at a position, fused by `fc` and `hidden_norm`, are
  projected by each layer's k_proj (then k_norm and RoPE) / v_proj into that layer's cache at the
  position's slot ("KV injection"): the draft never runs its layers over the context.
* `block`: one forward over the `[bonus, mask, ..., mask]` rows; every row attends to the injected
  context and to every row of its own block (non-causal: the metadata the caller builds decides).
* `draft_tokens`: the final norm, then the target's lm_head (or the draft's own, with d2t), argmax.
The model knows tokens, positions and slots, never requests.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from vllm_neuron.model.dflash.config import DFlashConfig, read_dflash_config
from vllm_neuron.model.draft_common import GatedMLP, check_d2t, copy_draft_params, read_draft_tensors
from vllm_neuron.model.layers.attention import AttentionMetadata, paged_attention, write_kv
from vllm_neuron.model.layers.linear import Linear
from vllm_neuron.model.layers.norm import RMSNorm
from vllm_neuron.model.layers.rotary import RotaryEmbedding, apply_rotary


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.scale = d**-0.5
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))

    def kv(self, x, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        k = apply_rotary(self.k_norm(self.k_proj(x).reshape(n, self.num_kv_heads, self.head_dim)), cos, sin)
        return k, self.v_proj(x).reshape(n, self.num_kv_heads, self.head_dim)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        q = apply_rotary(self.q_norm(self.q_proj(x).reshape(x.shape[0], self.num_heads, self.head_dim)), cos, sin)
        k, v = self.kv(x, cos, sin)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, None, None,
                              self.k_scale, self.v_scale)
        return self.o_proj(out)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DFlashConfig, max_positions: int, own_embedding: bool, own_lm_head: bool) -> None:
        super().__init__()
        from transformers import LlamaConfig

        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embedding else None
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.fc = Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False) if own_lm_head else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.rotary = RotaryEmbedding(LlamaConfig(**cfg.rope, head_dim=cfg.head_dim, hidden_size=h,
                                                  num_attention_heads=cfg.num_heads), max_positions)

    def kv_cache_specs(self) -> list[tuple[int, int]]:
        return [(self.cfg.num_kv_heads, self.cfg.head_dim)] * self.cfg.num_layers

    def write_context(self, features, positions, slots, kv_caches) -> None:
        """Injects the context K/V of the rows (target features [N, taps * target hidden]) at `slots`."""
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self.rotary(positions, ctx.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            a = layer.self_attn
            k, v = a.kv(ctx, cos, sin)
            write_kv(k_cache, v_cache, k, v, slots, a.k_scale, a.v_scale)

    def block(self, input_ids, positions, kv_caches, meta: AttentionMetadata,
              target_embed: nn.Module) -> torch.Tensor:
        """Final-normed hidden states [N, hidden] of the block rows (their K/V written at meta's slots)."""
        x = (target_embed if self.embed_tokens is None else self.embed_tokens)(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, meta)
        return self.norm(x)

    def draft_tokens(self, hidden: torch.Tensor, target_logits) -> torch.Tensor:
        """Greedy draft tokens as target ids; target_logits: the target's compute_logits."""
        if self.lm_head is None:
            return torch.argmax(target_logits(hidden).float(), dim=-1)
        idx = torch.argmax(self.lm_head(hidden).float(), dim=-1)
        return idx + self.d2t[idx]


_FIXED = ("fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "embed_tokens.weight", "d2t", "t2d")


def load_dflash_draft(path: str, *, dtype: torch.dtype, device: torch.device, target_vocab: int, target_hidden: int,
                      target_layers: int, k: int, max_positions: int) -> tuple[DFlashDraftModel, int]:
    """(draft model, bytes loaded); a checkpoint that does not fit the target or K is a ValueError naming why."""
    cfg = read_dflash_config(path)
    where = f"DFlash draft {path!r}"
    cfg.aux_layers(target_layers)
    if cfg.target_hidden_size != target_hidden:
        raise ValueError(f"{where}: trained on target hidden size {cfg.target_hidden_size}, the target has "
                         f"{target_hidden}")
    if cfg.vocab_size != target_vocab or cfg.draft_vocab_size > target_vocab:
        raise ValueError(f"{where}: vocab_size {cfg.vocab_size} / draft_vocab_size {cfg.draft_vocab_size} do not fit "
                         f"the target vocabulary ({target_vocab})")
    if cfg.mask_token_id >= target_vocab:
        raise ValueError(f"{where}: mask_token_id {cfg.mask_token_id} is outside the target vocabulary "
                         f"(0..{target_vocab - 1})")
    if cfg.block_size is not None and k > cfg.block_size - 1:
        raise ValueError(f"speculative_config.num_speculative_tokens={k} is larger than this DFlash draft proposes: "
                         f"its block_size {cfg.block_size} holds the bonus token and at most {cfg.block_size - 1} "
                         f"masked positions; choose 1..{cfg.block_size - 1}")
    if os.path.isfile(os.path.join(path, "mask_embedding.pt")):
        raise ValueError(f"{where}: a separate mask_embedding.pt is not supported yet (the mask rows use the "
                         f"embedding of mask_token_id)")
    tensors = {n.replace("midlayer.", "layers.0.", 1): t for n, t in read_draft_tensors(path, dtype).items()}
    unknown = sorted(n for n in tensors if not n.startswith("layers.") and n not in _FIXED)
    if unknown:
        raise ValueError(f"{where}: unexpected tensors {unknown[:6]} (expected layers.*, fc, hidden_norm, norm, and "
                         f"optionally lm_head, d2t, t2d, embed_tokens)")
    own_head = "lm_head.weight" in tensors
    if cfg.hidden_size != target_hidden and ("embed_tokens.weight" not in tensors or not own_head):
        raise ValueError(f"{where}: hidden_size {cfg.hidden_size} differs from the target's {target_hidden}, but the "
                         f"draft borrows the target's embedding / lm_head")
    if not own_head and cfg.draft_vocab_size != target_vocab:
        raise ValueError(f"{where}: draft_vocab_size {cfg.draft_vocab_size} needs the draft's own lm_head")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DFlashDraftModel(cfg, max_positions, "embed_tokens.weight" in tensors, own_head)
    finally:
        torch.set_default_dtype(prev)
    d2t = check_d2t(tensors.pop("d2t", None), cfg.draft_vocab_size, target_vocab, where) if own_head else None
    tensors.pop("t2d", None)
    if d2t is not None:
        model.d2t.copy_(d2t)
    nbytes = copy_draft_params(model, tensors.items(), where)
    return model.eval().requires_grad_(False), nbytes
