"""Prompt embeddings (`--enable-prompt-embeds`): a request's [seq_len, hidden] tensor in place of token ids.

Offline a prompt is `{"prompt_embeds": tensor}`; over HTTP `/v1/completions` takes vLLM's encoding, a base64
string of a `torch.save`d tensor, read with `weights_only=True` (no code runs, only tensors come back) after
its length is checked. Each check raises a ValueError naming the problem; the engine gets a contiguous CPU
tensor in the model's dtype and token ids of 0 in its place (vLLM's placeholders; the prefix cache keys such
a prompt by the embeddings' bytes, engine/core.py).
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import pickle

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def max_encoded_chars(max_model_len: int, hidden_size: int) -> int:
    """The longest base64 string a prompt of max_model_len fp32 embeddings can take (torch.save's container
    is a few KB around the data)."""
    return (max_model_len * hidden_size * 4 + (64 << 10)) * 4 // 3 + 4


def decode_prompt_embeds(encoded: str, max_chars: int) -> torch.Tensor:
    """vLLM's HTTP encoding -> the tensor (unchecked shape and values: see `check_prompt_embeds`)."""
    if not isinstance(encoded, str):
        raise ValueError(f"prompt_embeds must be a base64 string of a torch.save'd tensor, got {type(encoded).__name__}")
    if len(encoded) > max_chars:
        raise ValueError(f"prompt_embeds is {len(encoded)} base64 characters; a prompt of max_model_len embeddings "
                         f"takes at most {max_chars}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("prompt_embeds is not valid base64") from None
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"prompt_embeds is not a torch.save'd tensor that loads with weights_only=True: "
                         f"{str(e).splitlines()[0][:200]}") from None
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"prompt_embeds must hold a tensor, got {type(value).__name__}")
    return value


def check_prompt_embeds(t: object, hidden_size: int, dtype: torch.dtype | None, max_model_len: int) -> torch.Tensor:
    """A request's embeddings checked ([seq_len, hidden_size], or [1, seq_len, hidden_size]; floating point;
    finite) and cast to the model's `dtype` (None: kept) on the CPU."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 3 and t.shape[0] == 1:
        t = t[0]
    if t.dim() != 2 or t.shape[1] != hidden_size:
        raise ValueError(f"prompt_embeds must have shape [seq_len, {hidden_size}] (the model's hidden size), "
                         f"got {list(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"prompt_embeds must be float32, bfloat16 or float16, got {str(t.dtype).removeprefix('torch.')}")
    if t.shape[0] == 0:
        raise ValueError("prompt_embeds is empty (seq_len 0)")
    if t.shape[0] >= max_model_len:
        raise ValueError(f"prompt_embeds has {t.shape[0]} positions; the maximum model length is {max_model_len}")
    if t.is_sparse or t.layout != torch.strided:
        raise ValueError("prompt_embeds must be a dense tensor")
    if not bool(torch.isfinite(t).all()):
        raise ValueError("prompt_embeds contains NaN or infinite values")
    return t.detach().to("cpu", dtype or t.dtype).contiguous()


def embeds_digest(t: torch.Tensor) -> bytes:
    """The embeddings' bytes as a prefix-cache key part (same values, same dtype: same key)."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).digest()
