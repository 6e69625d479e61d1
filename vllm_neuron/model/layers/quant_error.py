"""How far weight-only int8 / int4 moved the weights it re-quantized: measured per tensor when a GGUF file's
(already quantized) weights are re-quantized onto our kernels, and summarized for the start-up log."""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_neuron.model.layers.quant_bands import BAND


@dataclass(frozen=True)
class QuantError:
    max_abs: float  # largest |re-quantized - original| over the tensor
    rel: float  # max_abs / the tensor's largest |original|


# Rows compared at a time: whole bands of the quantized layouts, few enough that a large lm_head is never
# copied whole in float32 on top of the model.
ROWS = 256 * BAND


def measure(original: torch.Tensor, dequantize_rows: Callable[[int, int], torch.Tensor]) -> QuantError:
    """The error against `original` [N, K] of the quantized weight, whose rows a..b `dequantize_rows(a, b)` puts
    back in float32."""
    max_abs = largest = 0.0
    for a in range(0, original.shape[0], ROWS):
        w = original[a:a + ROWS].detach().float()
        max_abs = max(max_abs, float((dequantize_rows(a, a + w.shape[0]) - w).abs().max()))
        largest = max(largest, float(w.abs().max()))
    return QuantError(max_abs, max_abs / max(largest, torch.finfo(torch.float32).tiny))


def summarize(errors: dict[str, QuantError]) -> str:
    """One line: the largest absolute and relative errors (and where), and the median relative error."""
    if not errors:
        return "no tensors"
    worst_abs = max(errors, key=lambda n: errors[n].max_abs)
    worst_rel = max(errors, key=lambda n: errors[n].rel)
    median = statistics.median(e.rel for e in errors.values())
    return (f"{len(errors)} tensors; max abs error {errors[worst_abs].max_abs:.3g} ({worst_abs}); error relative to "
            f"each tensor's largest |w|: median {median:.3g}, max {errors[worst_rel].rel:.3g} ({worst_rel})")
