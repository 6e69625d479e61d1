"""Rotary position embeddings as a lookup table indexed by position.

Static shapes: the cos/sin table covers every position up to max_position_embeddings, so a step only
gathers rows. Frequencies come from transformers' own RoPE initialisers (default, linear, llama3, yarn),
so scaling variants match the reference exactly.
"""
from __future__ import annotations

import torch
from torch import nn

# Types whose frequencies depend on the current sequence length cannot live in a static table.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    params = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default"}
    rope_type = params.get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported; supported rope types: {list(_STATIC_ROPE_TYPES)}"
        )
    if rope_type == "default":
        theta = params.get("rope_theta")
        if theta is None:
            raise ValueError("the model config has no rope_theta; refusing to guess a RoPE base")
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](hf_config)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, max_positions: int) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(hf_config)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos/sin: [N, D]."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    return x * cos + _rotate_half(x) * sin
