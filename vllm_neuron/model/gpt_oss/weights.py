"""gpt-oss checkpoint expert tensors -> the stacked-experts layout ([E, out, in], model/layers/moe.py).

Unquantized checkpoints (transformers' save) hold `experts.gate_up_proj` [E, H, 2I] and `down_proj`
[E, I, H]: transposed here. MXFP4 checkpoints (as gpt-oss ships) hold `<name>_blocks` + `<name>_scales`
already in [E, out, in/32] order: dequantized here, or passed through packed (`packed`, i.e.
neuron_config.quantization "mxfp4"), in which case unquantized experts are quantized instead.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from vllm_neuron.model.layers.mxfp4 import dequantize_mxfp4, quantize_mxfp4

_EXPERT = re.compile(r"^(.*\.mlp\.experts\.(?:gate_up_proj|down_proj))(_blocks|_scales)?$")


def expert_tensors(weights: Iterable[tuple[str, torch.Tensor]], *, packed: bool,
                   dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        m = _EXPERT.match(name)
        if m is None:
            yield name, t
            continue
        base, suffix = m.group(1), m.group(2)
        if suffix is None:
            if t.dim() != 3:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, expected 3 dimensions "
                                 f"[experts, in, out]")
            w = t.transpose(1, 2).contiguous()
            if packed:
                blocks, scales = quantize_mxfp4(w)
                yield base + "_blocks", blocks
                yield base + "_scales", scales
            else:
                yield base, w
            continue
        parts = pending.setdefault(base, {})
        parts[suffix] = t
        if len(parts) < 2:
            continue
        del pending[base]
        if packed:
            yield base + "_blocks", parts["_blocks"]
            yield base + "_scales", parts["_scales"]
        else:
            # One expert at a time: the whole tensor's lookup indices would take 8 bytes per weight.
            yield base, torch.stack([dequantize_mxfp4(b, s, dtype)
                                     for b, s in zip(parts["_blocks"], parts["_scales"])])
    if pending:
        base, parts = next(iter(pending.items()))
        missing = "_scales" if "_blocks" in parts else "_blocks"
        raise ValueError(f"checkpoint tensor {base + next(iter(parts))!r} has no matching {base + missing!r}")
