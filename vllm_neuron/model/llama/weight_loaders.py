"""Checkpoint tensor names (transformers') -> Llama-family parameters."""
from __future__ import annotations

from vllm_neuron.model.base import Target

# Checkpoint projection -> (fused parameter, shard index): the model runs q/k/v and gate/up as one matmul.
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def llama_checkpoint_target(model, name: str) -> Target | None:
    """q/k/v and gate/up tensors fill their rows of the fused parameter; the rest load by name."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight" and model.arch.tie_word_embeddings:
        return None  # tied: the embedding is the output layer
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in STACKED:
        fused, shard = STACKED[parts[-2]]
        owner = ".".join(parts[:-2])
        module = _submodule(model, owner)
        sizes = getattr(module, "qkv_sizes" if fused == "qkv_proj" else "gate_up_sizes", None)
        if sizes is not None and hasattr(module, fused):
            start = sum(sizes[:shard])
            return f"{owner}.{fused}.{parts[-1]}", (slice(start, start + sizes[shard]),), None
    return name, None, None


def _submodule(model, path: str):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
