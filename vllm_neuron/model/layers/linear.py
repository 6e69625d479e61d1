"""Linear layer: nn.Linear, plus the bf16 weight-streaming kernel for decode-sized batches.

At a few rows a linear layer is bound by streaming its weights; the custom kernel
(kernels/linear_bf16.cpp) gets 1.3-2.5x more bandwidth than oneDNN there on AVX512-BF16 CPUs. From
SMALL_BATCH_ROWS rows on, oneDNN is as fast and takes over. The switch is process-wide and set once
by the model runner; a graph sees it as a constant, so the choice is made when a bucket is traced.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = 4
_kernel_enabled = False


def set_small_batch_kernel(enabled: bool) -> None:
    global _kernel_enabled
    _kernel_enabled = enabled


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (_kernel_enabled and x.dim() == 2 and x.shape[0] <= SMALL_BATCH_ROWS and self.bias is None
                and x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16
                and self.in_features % 32 == 0):
            from vllm_neuron.model.layers.kernels import linear_bf16

            return linear_bf16(x, self.weight)
        return F.linear(x, self.weight, self.bias)
