"""The EAGLE3 draft head on the paged KV cache: one decoder layer over [embedding, fused target
features], its own K/V (one layer, same block tables as the target), a draft-vocabulary lm_head.

Step i of a proposal takes (the token at position p + 1, a hidden state for position p) and writes its
K/V at p. The first step's hidden state is `fc` of the target's three tapped layers at p; later steps
feed back the layer's own pre-norm output (as vLLM's EAGLE3). `draft_tokens` maps the draft's argmax to
target ids through `d2t`. The model knows tokens, positions and slots, never requests.
"""
from __future__ import annotations

import torch
from torch import nn

from vllm_neuron.model.draft_common import GatedMLP, check_d2t, copy_draft_params, read_draft_tensors
from vllm_neuron.model.eagle3.config import Eagle3Config, read_eagle3_config
from vllm_neuron.model.layers.attention import AttentionMetadata, paged_attention
from vllm_neuron.model.layers.linear import Linear
from vllm_neuron.model.layers.norm import RMSNorm
from vllm_neuron.model.layers.rotary import RotaryEmbedding, apply_rotary


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        # q/k/v read [embedding, features]: twice the hidden size.
        self.q_proj = Linear(2 * h, cfg.num_heads * d, bias=False)
        self.k_proj = Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = Linear(cfg.num_heads * d, h, bias=False)
        self.scale = d**-0.5
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32))
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32))

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q = apply_rotary(self.q_proj(x).reshape(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).reshape(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).reshape(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, None, None,
                              self.k_scale, self.v_scale)
        return self.o_proj(out)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size)


class Eagle3DraftModel(nn.Module):
    def __init__(self, cfg: Eagle3Config, max_positions: int, own_embedding: bool) -> None:
        super().__init__()
        from transformers import LlamaConfig

        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embedding else None
        self.fc = Linear(3 * cfg.target_hidden_size, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        rope = {k: v for k, v in cfg.raw.items() if k.startswith("rope") or k in ("head_dim", "hidden_size",
                                                                                 "num_attention_heads")}
        self.rotary = RotaryEmbedding(LlamaConfig(**rope), max_positions)

    def kv_cache_spec(self) -> tuple[int, int]:
        return self.cfg.num_kv_heads, self.cfg.head_dim

    def forward(self, input_ids, positions, hidden, kv_cache, meta: AttentionMetadata,
                target_embed: nn.Embedding) -> torch.Tensor:
        """Pre-norm output [N, hidden]; hidden: fc's output (first step) or the previous pre-norm output."""
        emb = (target_embed if self.embed_tokens is None else self.embed_tokens)(input_ids)
        cos, sin = self.rotary(positions, emb.dtype)
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        x = hidden + layer.self_attn(x, cos, sin, kv_cache, meta)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def draft_tokens(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens, as target ids."""
        idx = torch.argmax(self.lm_head(self.norm(prenorm)).float(), dim=-1)
        return idx + self.d2t[idx]


_FIXED = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight")


def load_eagle3_draft(path: str, *, dtype: torch.dtype, device: torch.device, target_vocab: int,
                      target_hidden: int, max_positions: int) -> tuple[Eagle3DraftModel, int]:
    """(draft model, bytes loaded); a checkpoint that does not fit the target is a ValueError naming why."""
    cfg = read_eagle3_config(path)
    where = f"EAGLE3 draft {path!r}"
    if cfg.target_hidden_size != target_hidden:
        raise ValueError(f"{where}: trained on target hidden size {cfg.target_hidden_size}, the target has "
                         f"{target_hidden}")
    if cfg.draft_vocab_size > target_vocab or cfg.vocab_size != target_vocab:
        raise ValueError(f"{where}: vocab_size {cfg.vocab_size} / draft_vocab_size {cfg.draft_vocab_size} do not "
                         f"fit the target vocabulary ({target_vocab})")
    tensors = read_draft_tensors(path, dtype)
    unknown = sorted(n for n in tensors if not n.startswith("midlayer.") and n not in _FIXED)
    if unknown:
        raise ValueError(f"{where}: unexpected tensors {unknown[:6]} (expected midlayer.*, fc, norm, lm_head, "
                         f"d2t, t2d, embed_tokens)")
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Eagle3DraftModel(cfg, max_positions, own_embedding="embed_tokens.weight" in tensors)
    finally:
        torch.set_default_dtype(prev)
    d2t = check_d2t(tensors.pop("d2t", None), cfg.draft_vocab_size, target_vocab, where)
    t2d = tensors.pop("t2d", None)
    if d2t is not None:
        model.d2t.copy_(d2t)
    if t2d is not None and tuple(t2d.shape) != (target_vocab,):
        raise ValueError(f"{where}: t2d has shape {tuple(t2d.shape)}, expected ({target_vocab},)")
    nbytes = copy_draft_params(model, tensors.items(), where)
    return model.eval().requires_grad_(False), nbytes
