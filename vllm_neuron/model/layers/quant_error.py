"""How far weight-only int8 / int4 moved the weights it re-quantized: measured per tensor when a GGUF file's
(already quantized) weights are re-quantized onto our kernels, and summarized for the start-up log."""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantError:
    max_abs: float  # largest |re-quantized - original| over the tensor
    rel: float  # max_abs / the tensor's largest |original|


def measure(original: torch.Tensor, requantized: torch.Tensor) -> QuantError:
    """The error of `requantized` (the quantized weight put back in float) against `original`, in float32."""
    w = original.detach().float()
    max_abs = float((requantized.float() - w).abs().max())
    return QuantError(max_abs, max_abs / max(float(w.abs().max()), torch.finfo(torch.float32).tiny))


def summarize(errors: dict[str, QuantError]) -> str:
    """One line: the largest absolute and relative errors (and where), and the median relative error."""
    if not errors:
        return "no tensors"
    worst_abs = max(errors, key=lambda n: errors[n].max_abs)
    worst_rel = max(errors, key=lambda n: errors[n].rel)
    median = statistics.median(e.rel for e in errors.values())
    return (f"{len(errors)} tensors; max abs error {errors[worst_abs].max_abs:.3g} ({worst_abs}); error relative to "
            f"each tensor's largest |w|: median {median:.3g}, max {errors[worst_rel].rel:.3g} ({worst_rel})")
