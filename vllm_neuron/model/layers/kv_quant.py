"""FP8 KV cache (vLLM's `kv_cache_dtype` "fp8" / "fp8_e4m3" / "fp8_e5m2"): K and V are quantized when
written to the cache and dequantized when read; attention itself runs in the compute dtype.

Each layer has a per-tensor `k_scale` and `v_scale` (stored value = x / scale), read from the checkpoint
when it carries them (ModelOpt `k_proj.k_scale`, compressed-tensors `self_attn.k_scale`), else 1.0.
Values beyond the format's largest finite number are clamped to it before the cast (the seeds' clamp:
448 for E4M3, 57344 for E5M2 on these devices; Trainium2's E4M3 stops at 240): E5M2 would otherwise
turn them into inf.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from vllm_neuron.logger import init_logger

logger = init_logger(__name__)
FP8_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: the model dtype for "auto", else the FP8 format."""
    return model_dtype if kv_cache_dtype == "auto" else FP8_KV_DTYPES[kv_cache_dtype]  # validated by EngineConfig


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def dequantize(c: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (c.float() * scale).to(dtype)


def tap_scales(weights: Iterable[tuple[str, torch.Tensor]], names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Passes checkpoint tensors through, noting the names of KV-cache scales in `names`."""
    for name, tensor in weights:
        if name.endswith(("k_scale", "v_scale")):
            names.append(name)
        yield name, tensor


def log_scales(kv_cache_dtype: str, names: list[str], num_layers: int) -> None:
    if len(names) >= 2 * num_layers:
        logger.info("FP8 KV cache (%s): k/v scales from the checkpoint for all %d layers", kv_cache_dtype, num_layers)
    elif names:
        logger.warning("FP8 KV cache (%s): the checkpoint has %d of %d k/v scales; the others are 1.0",
                       kv_cache_dtype, len(names), 2 * num_layers)
    else:
        logger.warning("FP8 KV cache (%s): the checkpoint has no k/v scales, so every scale is 1.0: values are "
                       "stored as they are (clamped to the format's range), which can cost accuracy; use a "
                       "checkpoint with calibrated scales", kv_cache_dtype)
