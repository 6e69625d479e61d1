"""Typed view of a Hugging Face Llama-family config: only what the modules read."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LlamaArchConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before RoPE

    @classmethod
    def from_hf(cls, hf, family: str = "Llama", activations: tuple[str, ...] = ("silu", "swish"),
                **extra) -> "LlamaArchConfig":
        """`activations`: the MLP activations the family's modules compute (the first one named in errors)."""
        heads = hf.num_attention_heads
        act = getattr(hf, "hidden_act", None) or getattr(hf, "hidden_activation", None)  # Gemma: the latter
        if act not in activations:
            raise ValueError(f"hidden_act={act!r} is not supported for {family}; supported: ['{activations[0]}']")
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            hidden_act=act,
            **extra,
        )


def layer_windows(hf, family: str, default_type: str = "full_attention") -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) from `layer_types` (default: every layer
    `default_type`) and `sliding_window`; a ValueError for types that are neither."""
    n = hf.num_hidden_layers
    window = getattr(hf, "sliding_window", None)
    types = list(getattr(hf, "layer_types", None) or [default_type] * n)
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n:
        raise ValueError(f"{family} layer_types {types} are not supported; each of the {n} layers must be "
                         f"'sliding_attention' or 'full_attention'")
    if "sliding_attention" in types and not window:
        raise ValueError(f"{family} layer_types has sliding_attention layers but sliding_window is not set")
    return tuple(int(window) if t == "sliding_attention" else None for t in types)
