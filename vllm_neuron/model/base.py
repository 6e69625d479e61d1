"""The model contract: what every architecture takes, returns and declares to the runner.

A model is a `CausalLM` (an nn.Module) built as `cls(hf_config, quantization=None)` from a Hugging
Face config (`quantization` is neuron_config.quantization, for models that apply one themselves). The
runner only ever:

* asks `cls.spec(hf_config)` - before building it - what the KV cache and the graphs need
  (`ModelSpec`: layers, KV heads, head dim, per-layer sliding windows, MoE, attention sinks);
* calls `forward(input_ids, positions, kv_caches, meta, **inputs)` -> hidden states [N, hidden]
  for N (padded) tokens; `inputs` are the model kind's named inputs (worker/model_kinds/: e.g. Qwen3-VL's
  `mm` in a prefill, `rope_delta` per decode row), and `aux_layers=(...)` for a target a draft model taps
  (then the result is (hidden states, the tapped layers' inputs)); `kv_caches[i]` is layer i's (K, V) pair of [slots, kv_heads, head_dim]
  tensors, `meta` the step's `AttentionMetadata` shared by all layers, or a list of one per layer
  (KV cache groups, kv_cache_groups.py: layers of different groups write and read through different
  block tables, and layers of the same index in different groups share one K/V tensor pair);
* calls `compute_logits(hidden)` -> [rows, vocab];
* feeds `load_weights(iterable of (checkpoint name, tensor))` the tensors of a safetensors folder or
  a GGUF file (both yield transformers' names); it returns the bytes loaded and raises a ValueError
  naming the first tensor that has no parameter or the wrong shape, or the parameters left unloaded.

`load_named_weights` implements the loading for models that say, per checkpoint name, which
parameter (and which part of it) a tensor fills (`checkpoint_target`).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from vllm_neuron.model.layers.parallel import rank_tensor


@dataclass(frozen=True)
class ModelSpec:
    """What the runner may ask of a model's config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    # Per layer: the number of most recent tokens a query sees, None for full attention.
    sliding_windows: tuple[int | None, ...]
    is_moe: bool = False
    attention_sinks: bool = False
    # neuron_config.quantization values the model honours (int8 and int4 apply to every `Linear`).
    quantizations: tuple[str, ...] = ("int8", "int4")
    # The attention's values are its keys (MLA's latent): the pool holds one tensor per layer, passed as both.
    values_are_keys: bool = False

    def __post_init__(self) -> None:
        if len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers")

    @property
    def has_sliding_window(self) -> bool:
        return any(w is not None for w in self.sliding_windows)

    @property
    def has_sinks_or_windows(self) -> bool:
        """The CPU kernel and the torch path do sinks and sliding windows; the CUDA paged decode (Triton)
        is plain causal, so such models decode through the torch path there."""
        return self.attention_sinks or self.has_sliding_window


# Where a checkpoint tensor goes: (parameter name, index into the parameter or None for all of it,
# transform applied to the tensor first or None); None skips the tensor (e.g. rotary caches).
Target = tuple[str, tuple | None, Callable[[torch.Tensor], torch.Tensor] | None]


class CausalLM(nn.Module):
    """Base class of every architecture (see the module docstring for the contract)."""

    @classmethod
    def spec(cls, hf_config) -> ModelSpec:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings forward() starts from (prompt embeddings replace some rows of them)."""
        raise NotImplementedError(f"{type(self).__name__} does not take prompt embeddings")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """(num_layers, num_kv_heads, head_dim) - what the KV cache allocator needs."""
        s = self.model_spec
        return s.num_layers, s.num_kv_heads, s.head_dim

    def checkpoint_target(self, name: str) -> Target | None:
        """Default: the parameter of the same name, whole."""
        return name, None, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        return load_named_weights(self, weights)


def load_named_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copies every tensor into its target (`model.checkpoint_target`); returns the bytes loaded.

    Every parameter must be filled completely (a missing part would silently stay random) and every
    tensor must land somewhere (an unknown one means the architecture is not what we think)."""
    params = dict(model.named_parameters())
    targets = {**dict(model.named_buffers()), **params}  # buffers: e.g. FP8 KV-cache scales
    filled: dict[str, int] = {}
    nbytes = 0
    for name, tensor in weights:
        target = model.checkpoint_target(name)
        if target is None:
            continue
        pname, index, transform = target
        if pname not in targets:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(model).__name__}")
        p = targets[pname]
        dest = p if index is None else p[index]
        if transform is not None:
            tensor = transform(tensor)
        tensor = rank_tensor(p, tensor, tuple(dest.shape))  # tensor parallelism: this rank's piece
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected "
                             f"{tuple(dest.shape)} (parameter {pname!r})")
        with torch.no_grad():
            dest.copy_(tensor.to(p.dtype))
        filled[pname] = filled.get(pname, 0) + dest.numel()
        nbytes += dest.numel() * dest.element_size()
    # named_parameters() lists a tied weight once, under its first owner (the embedding).
    missing = sorted(n for n, p in params.items() if filled.get(n, 0) < p.numel())
    if missing:
        raise ValueError(f"checkpoint lacks tensors for parameters: {missing[:8]}")
    return nbytes
