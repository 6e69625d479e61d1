"""LoRA inside the graphs: every adapted `Linear` holds a slot table of adapters, and each token's delta is
computed from its own adapter's slot, so one step serves tokens of many adapters and of the base model.

A `LoRASlots` holds, for `num_slots` slots, A [slots, R, in] and B^T [slots, R, out] (the scaling folded
into B, ranks zero-padded to R). Slot 0 stays zero: the base model's tokens and padding read it and get a
zero delta. The tensors are module buffers updated in place when an adapter takes a slot, so a compiled
graph reads whatever is resident and is never traced again. A fused projection (q/k/v, gate/up) stacks its
sub-projections' ranks: sub-projection i owns rows [i * rank, (i + 1) * rank) of A and writes only its
own output columns of B^T, so one shrink and one expand serve the three (two) of them.

`lora_delta` is the batched gathered matmul (punica's BGMV idea): with fewer tokens than slots each token
gathers its slot's A and B and runs two small bmm's; with more tokens than slots every slot's shrink runs
as one matmul over all tokens, masked to each token's slot, then one expand (the gather would copy more
weight than the slots hold). Both are exact; `benchmarks/lora_overhead.py --kernels` times them.
Where the engine's kernels take the dtype (`kernels.linear_dtypes`), decode-sized steps (up to KERNEL_ROWS
rows) take the custom op instead (kernels/lora.cpp): each row's shrink and expand by its own slot in one
call. torch's form is two matmuls of 15-25 us each on these small shapes plus the masking between them,
per adapted projection and step (measured on AVX512-BF16, 2 threads).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm_neuron.model.layers.kernel_config import KernelConfig
from vllm_neuron.model.layers.kernels import ops
from vllm_neuron.model.layers.linear import Linear

# Steps up to this many rows take the weight-streaming kernel (decode and verification steps).
KERNEL_ROWS = 64


def lora_delta(x: torch.Tensor, index: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """x [n, in], index [n] (slot per token), a [S, R, in], b_t [S, R, out] -> [n, out] in x's dtype; the path
    is chosen by the (static) shapes."""
    return lora_delta_gathered(x, index, a, b_t) if x.shape[0] < a.shape[0] else lora_delta_dense(x, index, a, b_t)


def lora_delta_gathered(x: torch.Tensor, index: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """BGMV: each token gathers its slot's A and B^T, two batched matmuls."""
    shrunk = torch.bmm(a.index_select(0, index), x.unsqueeze(-1))  # [n, R, 1]
    return torch.bmm(shrunk.transpose(1, 2), b_t.index_select(0, index)).squeeze(1)


def lora_delta_dense(x: torch.Tensor, index: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """Every slot's shrink over all tokens as one matmul, each token's own slot kept, one expand. Slot 0 is all
    zeros: only slots 1.. take part."""
    n = x.shape[0]
    slots, rank, _ = a.shape
    used = slots - 1
    shrunk = F.linear(x, a[1:].reshape(used * rank, -1)).view(n, used, rank)
    own = index[:, None] == torch.arange(1, slots, device=index.device)[None, :]
    shrunk = shrunk * own.to(x.dtype)[:, :, None]
    return shrunk.reshape(n, used * rank) @ b_t[1:].reshape(used * rank, -1)


class LoRASlots(nn.Module):
    """One Linear's adapters (see the module docstring). `sizes`: the output columns of each sub-projection
    (one entry for a plain projection); `rank`: the largest rank one sub-projection may have."""

    kernels = KernelConfig()  # its Linear's (attach_lora)

    def __init__(self, num_slots: int, rank: int, in_features: int, sizes: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.sizes = tuple(sizes)
        self.rank = rank
        width = rank * len(self.sizes)
        self.register_buffer("lora_a", torch.zeros(num_slots, width, in_features, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(num_slots, width, sum(self.sizes), dtype=dtype, device=device))

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if (self.kernels.lora and x.dim() == 2 and x.shape[0] <= KERNEL_ROWS and x.dtype in self.kernels.linear_dtypes
                and x.dtype == self.lora_a.dtype):
            return ops.lora_delta(x, index, self.lora_a, self.lora_b)
        return lora_delta(x, index, self.lora_a, self.lora_b)

    @torch.no_grad()
    def write(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot `slot` <- one (A [r, in], B [out_i, r]) per sub-projection, None where the adapter leaves it."""
        if slot == 0:
            raise ValueError("slot 0 is the base model's (always zero)")
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        col = 0
        for i, (size, part) in enumerate(zip(self.sizes, parts)):
            if part is not None:
                a, b = part
                r = a.shape[0]
                self.lora_a[slot, i * self.rank:i * self.rank + r].copy_(a)
                self.lora_b[slot, i * self.rank:i * self.rank + r, col:col + size].copy_(b.t())
            col += size

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()


# The model's fused projections -> the checkpoint projections they stack, in order, and their parallel style
# (column: outputs split over tensor-parallel ranks; row: inputs split, summed by the all-reduce after).
FUSED_TARGETS: dict[str, tuple[tuple[str, ...], str]] = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), "column"),
    "o_proj": (("o_proj",), "row"),
    "gate_up_proj": (("gate_proj", "up_proj"), "column"),
    "down_proj": (("down_proj",), "row"),
}


def attach_lora(model: nn.Module, num_slots: int, rank: int, dtype: torch.dtype,
                device: torch.device) -> dict[tuple[int, str], LoRASlots]:
    """Gives every decoder layer's q/k/v, o, gate/up and down Linear a `LoRASlots` (`linear.lora`); returns
    them by (layer, fused name). Raises when the model is not built of the Llama family's layers."""
    if not getattr(model, "takes_lora", True):  # a family whose layers do not pass adapters through (yet)
        raise ValueError(f"enable_lora=True is not supported yet for {type(model).__name__}; LoRA serves the dense "
                         f"Llama / Qwen3 families")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"LoRA is not supported for {type(model).__name__}: no decoder layers to adapt")
    out: dict[tuple[int, str], LoRASlots] = {}
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        owners = {"qkv_proj": (attn, "qkv_sizes"), "o_proj": (attn, None), "gate_up_proj": (mlp, "gate_up_sizes"),
                  "down_proj": (mlp, None)}
        for name, (owner, sizes_attr) in owners.items():
            linear = getattr(owner, name, None)
            if not isinstance(linear, Linear):
                raise ValueError(f"LoRA is not supported for {type(model).__name__}: layer {i} has no {name} Linear")
            sizes = getattr(owner, sizes_attr) if sizes_attr else (linear.out_features,)
            linear.lora = LoRASlots(num_slots, rank, linear.in_features, sizes, dtype, device)
            linear.lora.kernels = linear.kernels
            out[(i, name)] = linear.lora
    return out
