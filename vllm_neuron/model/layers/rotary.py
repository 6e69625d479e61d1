"""Rotary position embeddings as a lookup table indexed by position.

Static shapes: the cos/sin table covers every position up to max_position_embeddings, so a step only
gathers rows. Frequencies come from transformers' own RoPE initialisers (default, linear, llama3, yarn,
longrope), so scaling variants match the reference exactly. A `partial_rotary_factor` below 1 rotates only
the first part of each head (the table is narrower than the head; `apply_rotary` passes the rest through).
"""
from __future__ import annotations

import torch
from torch import nn

# Types whose frequencies depend on the current sequence length cannot live in a static table (LongRoPE's
# short/long choice is made once, by the caller: `long_factors`).
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The config's rope dict; with `layer_type`, that layer type's (Gemma 3 nests one per type)."""
    params = getattr(hf_config, "rope_parameters", None) or {"rope_type": "default"}
    if layer_type is not None:
        if layer_type not in params:
            raise ValueError(f"the model config has no rope_parameters for {layer_type!r} layers")
        params = params[layer_type]
    return params


def rope_inv_freq(hf_config, layer_type: str | None = None, long_factors: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin scaling). `layer_type`: the nested rope dict of that layer type;
    `long_factors`: LongRoPE's long_factor set (the one transformers uses past original_max_position_embeddings)
    instead of short_factor."""
    params = rope_parameters(hf_config, layer_type)
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
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kw: dict = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "longrope" and long_factors:
        kw["seq_len"] = params["original_max_position_embeddings"] + 1
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **kw)


class RotaryEmbedding(nn.Module):
    def __init__(self, hf_config, max_positions: int, layer_type: str | None = None,
                 long_factors: bool = False) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(hf_config, layer_type, long_factors)
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
    """x: [N, heads, D]; cos/sin: [N, R], R <= D (partial rotary: the last D - R dims pass through)."""
    cos = cos[:, None, :]
    sin = sin[:, None, :]
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        x_rot, x_pass = x[..., :rot], x[..., rot:]
        return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
    return x * cos + _rotate_half(x) * sin
