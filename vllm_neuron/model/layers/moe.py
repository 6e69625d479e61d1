"""Mixture-of-experts layers on static shapes: routers and stacked experts.

Experts are stacked per layer: gate_up [E, 2I, H] and down [E, H, I] (F.linear's [out, in] layout),
with optional biases [E, 2I] and [E, H]. A step computes experts in one of two ways, chosen from its
static shape (so per bucket, when the graph is traced):

* gather (N tokens x top-k <= E, i.e. decode batches): the weights of each (token, expert) pair are
  gathered and applied with two batched matmuls. The step reads N x k experts' weights - at most what
  the batch touches - so its cost follows the active experts, like a dense model of the active size
  (plus the gather copy).
* dense (larger N, i.e. prefill): every expert runs over every token in two einsums and the router
  weights (zero for unselected experts) combine the results. Each expert's weights are streamed once
  and reused across the N tokens; the arithmetic is E / k times the active work, the price of static
  shapes without per-expert token counts.

The dense path runs in `kernels.matmul_dtype`: on the AVX2 class bf16 experts are widened to fp32 for its
matmuls (oneDNN's emulated bf16 took 2.4x as long at 256 tokens x 32 experts) and the result rounded back once.
The gathered path keeps bf16 there: its matrix-vector products stream the weights, and widening the gathered
copies took 2.6x as long as the bf16 products.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vllm_neuron.model.layers.activation import silu_and_mul
from vllm_neuron.model.layers.kernel_config import KernelConfig
from vllm_neuron.model.layers.mxfp4 import GROUP, dequantize_mxfp4


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-style routing: softmax over all experts (fp32), top-k, optional renormalisation.
    Returns (weights [N, k] in the logits' dtype, expert ids [N, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss routing: top-k of the logits, softmax over those k."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids


class StackedExperts(nn.Module):
    """E experts as stacked parameters (transformers' names: gate_up_proj, down_proj and their biases).

    With `mxfp4` the weights stay packed (`gate_up_proj_blocks` / `_scales`, `down_proj_blocks` /
    `_scales`, gpt-oss's checkpoint names) and only the experts a step uses are dequantized, inside
    the graph; biases stay in the compute dtype."""

    kernels = KernelConfig()  # the engine's, set when the model is built (kernel_config.apply_kernel_config)

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] | None = None, mxfp4: bool = False) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.mxfp4 = mxfp4
        if mxfp4:
            for name, rows, cols in (("gate_up_proj", 2 * intermediate_size, hidden_size),
                                     ("down_proj", hidden_size, intermediate_size)):
                if cols % GROUP:
                    raise ValueError(f"MXFP4 experts need {name} input size divisible by {GROUP}, got {cols}")
                shape = (num_experts, rows, cols // GROUP)
                self.register_parameter(f"{name}_blocks", nn.Parameter(
                    torch.empty(*shape, GROUP // 2, dtype=torch.uint8), requires_grad=False))
                self.register_parameter(f"{name}_scales", nn.Parameter(
                    torch.empty(shape, dtype=torch.uint8), requires_grad=False))
        else:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
            self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        if bias:
            self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.has_bias = bias
        self.activation = activation  # None: silu(gate) * up

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation is None:
            return silu_and_mul(h, self.kernels.activation)
        return self.activation(h)

    def expert_weights(self, ids: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) of the experts `ids` ([M] -> [M, 2I, H], [M, H, I]), or of all experts."""
        if self.mxfp4:
            def weight(name: str) -> torch.Tensor:
                blocks, scales = getattr(self, f"{name}_blocks"), getattr(self, f"{name}_scales")
                if ids is not None:
                    blocks, scales = blocks[ids], scales[ids]
                return dequantize_mxfp4(blocks, scales, dtype)

            return weight("gate_up_proj"), weight("down_proj")
        if ids is None:
            return self.gate_up_proj, self.down_proj
        return self.gate_up_proj[ids], self.down_proj[ids]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [N, H]; weights, ids [N, k] (the router's choice) -> [N, H]."""
        n, k = ids.shape
        if n * k <= self.num_experts:
            return self._gathered(x, weights, ids)
        return self._dense(x, weights, ids)

    def _gathered(self, x, weights, ids) -> torch.Tensor:
        n, k = ids.shape
        flat = ids.reshape(-1)
        gate_up, down = self.expert_weights(flat, x.dtype)
        xs = x[:, None, :].expand(n, k, x.shape[-1]).reshape(n * k, x.shape[-1], 1)
        h = torch.bmm(gate_up.to(x.dtype), xs)[..., 0]  # [n*k, 2I]
        if self.has_bias:
            h = h + self.gate_up_proj_bias[flat]
        h = self._activate(h)
        y = torch.bmm(down.to(x.dtype), h[..., None])[..., 0]  # [n*k, H]
        if self.has_bias:
            y = y + self.down_proj_bias[flat]
        return (y.view(n, k, -1) * weights[..., None].to(y.dtype)).sum(dim=1)

    def _dense(self, x, weights, ids) -> torch.Tensor:
        dtype = self.kernels.matmul_dtype(x.dtype)
        gate_up, down = self.expert_weights(None, dtype)
        h = torch.einsum("nh,eoh->eno", x.to(dtype), gate_up.to(dtype))  # [E, N, 2I]
        if self.has_bias:
            h = h + self.gate_up_proj_bias[:, None, :].to(dtype)
        h = self._activate(h)
        y = torch.einsum("eni,ehi->enh", h, down.to(dtype))  # [E, N, H]
        if self.has_bias:
            y = y + self.down_proj_bias[:, None, :].to(dtype)
        combine = torch.zeros(x.shape[0], self.num_experts, dtype=dtype, device=x.device)
        # [N, E]: router weight of each chosen expert; added, because expert parallelism maps the pairs of
        # other ranks' experts onto a local one with weight 0 (Qwen3-MoE), which must not overwrite it.
        combine.scatter_add_(1, ids, weights.to(dtype))
        return torch.einsum("ne,enh->nh", combine, y).to(x.dtype)
