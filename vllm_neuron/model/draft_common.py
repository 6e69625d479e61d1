"""What the speculative draft heads (EAGLE3, DFlash) share: the gated MLP, reading a draft checkpoint's
tensors, copying them onto parameters with start-up errors that name the tensor, the d2t map check."""
from __future__ import annotations

import json
import os
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from vllm_neuron.model.layers.linear import Linear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def read_draft_config(path: str, kind: str) -> dict:
    """The draft checkpoint's config.json; a directory without one is a ValueError naming it."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"speculative_config.model={path!r}: no config.json (a {kind} draft checkpoint directory "
                         f"holds config.json and *.safetensors)")
    with open(cfg_path, encoding="utf-8") as f:
        return json.load(f)


def read_draft_tensors(path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors, names without a leading `model.`."""
    from vllm_neuron.model.loader.safetensors_loader import iter_safetensors_weights

    return {name.removeprefix("model."): t for name, t in iter_safetensors_weights(path, dtype)}


def check_d2t(d2t: torch.Tensor | None, draft_vocab: int, target_vocab: int, where: str) -> torch.Tensor | None:
    """The draft -> target id offsets (target id = draft id + d2t[draft id]), validated; None: identity."""
    if d2t is None:
        if draft_vocab != target_vocab:
            raise ValueError(f"{where}: draft_vocab_size {draft_vocab} differs from the target's {target_vocab} "
                             f"but the checkpoint has no d2t map")
        return None
    mapped = torch.arange(d2t.shape[0]) + d2t.long()
    if tuple(d2t.shape) != (draft_vocab,) or int(mapped.min()) < 0 or int(mapped.max()) >= target_vocab:
        raise ValueError(f"{where}: d2t (shape {tuple(d2t.shape)}) must map {draft_vocab} draft ids "
                         f"into the target vocabulary 0..{target_vocab - 1}")
    return d2t.long()


def copy_draft_params(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> int:
    """Copies each tensor onto the parameter of its name (bytes copied); an unknown, missing or misshapen
    tensor is a ValueError naming it."""
    params = dict(model.named_parameters())
    nbytes, filled = 0, set()
    for name, t in tensors:
        p = params.get(name)
        if p is None:
            raise ValueError(f"{where}: tensor {name!r} has no matching parameter")
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
        filled.add(name)
        nbytes += p.numel() * p.element_size()
    missing = sorted(set(params) - filled)
    if missing:
        raise ValueError(f"{where}: checkpoint lacks tensors {missing[:6]}")
    return nbytes
