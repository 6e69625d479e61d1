"""Checkpoint tensors (transformers names) -> Llama parameters."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def load_llama_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copies every tensor into the parameter of the same name; returns the bytes loaded.

    Every parameter must be covered (a missing one would silently stay random) and every tensor must
    land somewhere (an unknown one means the architecture is not what we think)."""
    params = dict(model.named_parameters())
    tied = getattr(model, "arch", None) is not None and model.arch.tie_word_embeddings
    loaded: set[str] = set()
    nbytes = 0
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and tied:
            continue  # tied: the embedding is the output layer
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        p = params[name]
        if tuple(tensor.shape) != tuple(p.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(tensor.to(p.dtype))
        loaded.add(name)
        nbytes += p.numel() * p.element_size()
    missing = set(params) - loaded
    if tied:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint lacks tensors for parameters: {sorted(missing)[:8]}")
    return nbytes
