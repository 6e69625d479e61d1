"""FP8 static weights from a ModelOpt checkpoint: detected from the checkpoint's `quantization_config`, no flag.

ModelOpt's FP8 export stores each linear weight as float8_e4m3fn with a per-tensor fp32 `weight_scale`
(w = weight * weight_scale) and a static `input_scale` for activations. Linear layers keep the FP8 weight
in memory and compute in the compute dtype: the FP8 values are exact in bf16/fp16/fp32, and a per-output-row
scale commutes with the matmul, so y = (x @ weight^T) * scale. Fused q/k/v and gate/up layers hold one
scale per output row (each checkpoint projection's scale on its rows). Activations are not quantized, so
`input_scale` has no use here and is skipped.

Any other scheme in `quantization_config` fails at start-up naming it (the seeds: never a silent fallback to
bf16). A compressed-tensors config that quantizes only the KV cache (`kv_cache_scheme`, no weight groups)
is accepted: its k/v scales serve the FP8 KV cache.
"""
from __future__ import annotations

import fnmatch
from typing import Any

import torch

from vllm_neuron.model.layers.quant_int8 import scaled_linear

FP8_DTYPE = torch.float8_e4m3fn


def _as_dict(qc: Any) -> dict:
    return qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc)))


def checkpoint_weight_scheme(hf_config, model_quantizations: tuple[str, ...] = ()) -> tuple[str | None, list[str]]:
    """("fp8", modules left unquantized) for a ModelOpt FP8 checkpoint, (None, []) without weight
    quantization or with a scheme the model's own loader reads (`model_quantizations`, e.g. gpt-oss's
    MXFP4 experts, dequantized at load); ValueError naming any other scheme."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return None, []
    qc = _as_dict(qc)
    method = str(qc.get("quant_method", "")).lower()
    if method and method in model_quantizations:
        return None, []
    if method == "compressed-tensors" and not qc.get("config_groups"):
        return None, []  # KV-cache scales only
    algo = str(qc.get("quant_algo") or (qc.get("quantization") or {}).get("quant_algo") or "").upper()
    if method in ("modelopt", "") and algo == "FP8":
        return "fp8", list(qc.get("exclude_modules") or qc.get("ignore") or [])
    scheme = f"{method or 'unknown'}" + (f" ({algo})" if algo else "")
    hint = (" (weight quantization from compressed-tensors is refused; only its kv_cache_scheme k/v scales are "
            "accepted)" if method == "compressed-tensors" else "")
    raise ValueError(f"the checkpoint's quantization_config requests {scheme!r}, which vllm-neuron does not support"
                     f"{hint}; supported: ModelOpt FP8 static weights (quant_method 'modelopt', quant_algo 'FP8'), "
                     f"or an unquantized checkpoint with neuron_config.quantization int8/int4")


def excluded(module_name: str, patterns: list[str]) -> bool:
    """Whether a module stays unquantized (`exclude_modules` patterns such as "lm_head" or "*.mlp.gate")."""
    return any(fnmatch.fnmatch(module_name, p) or module_name.endswith("." + p) or module_name == p
               for p in patterns)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, fp32 per-tensor scale) the way ModelOpt calibrates weights: amax / 448."""
    scale = (weight.detach().float().abs().amax() / torch.finfo(FP8_DTYPE).max).clamp(min=1e-12)
    return (weight.detach().float() / scale).to(FP8_DTYPE), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (weight.float() * scale.reshape(-1, 1)).to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = scaled_linear(x, weight, scale)
    return y if bias is None else y + bias
