"""Checkpoint tensors (transformers names) -> Llama parameters."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


# Checkpoint projection -> (fused parameter, shard index): the model runs q/k/v and gate/up as one matmul.
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _target(name: str, params: dict) -> tuple[str, int | None]:
    """(parameter name, shard index or None) for a checkpoint tensor name."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in STACKED:
        fused, shard = STACKED[parts[-2]]
        fused_name = ".".join(parts[:-2] + [fused, parts[-1]])
        if fused_name in params:
            return fused_name, shard
    return name, None


def _shard_rows(model: nn.Module, param_name: str, shard: int, total: int) -> tuple[int, int]:
    module = model.get_submodule(param_name.rsplit(".", 1)[0].rsplit(".", 1)[0])
    sizes = getattr(module, "qkv_sizes", None) if param_name.split(".")[-2] == "qkv_proj" else None
    if sizes is None:  # gate_up: two equal halves
        sizes = (total // 2, total // 2)
    start = sum(sizes[:shard])
    return start, start + sizes[shard]


def load_llama_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copies every tensor into the parameter of the same name (or its rows of a fused q/k/v or
    gate/up parameter); returns the bytes loaded.

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
        target, shard = _target(name, params)
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        p = params[target]
        dest = p
        if shard is not None:
            lo, hi = _shard_rows(model, target, shard, p.shape[0])
            dest = p[lo:hi]
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor.to(p.dtype))
        loaded.add(name if shard is None else f"{target}#{shard}")
        nbytes += dest.numel() * dest.element_size()
    shards: dict[str, int] = {}
    for key in loaded:
        if "#" in key:
            base = key.split("#")[0]
            shards[base] = shards.get(base, 0) + 1
    for base, count in shards.items():
        if count == (3 if base.split(".")[-2] == "qkv_proj" else 2):
            loaded.add(base)
    missing = set(params) - loaded
    if tied:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint lacks tensors for parameters: {sorted(missing)[:8]}")
    return nbytes
