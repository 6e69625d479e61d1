"""Checkpoint tensor names (transformers') -> Llama-family parameters."""
from __future__ import annotations

from vllm_neuron.model.base import Target

# Checkpoint projection -> (fused parameter, shard index): the model runs q/k/v and gate/up as one matmul.
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
KV_SCALES = ("k_scale", "v_scale", "q_scale")


def llama_checkpoint_target(model, name: str) -> Target | None:
    """q/k/v and gate/up tensors fill their rows of the fused parameter; the rest load by name."""
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if name == "lm_head.weight" and model.arch.tie_word_embeddings:
        return None  # tied: the embedding is the output layer
    parts = name.split(".")
    if parts[-1] in KV_SCALES:
        return kv_scale_target(parts)
    if parts[-1] == "input_scale":
        return None  # FP8 checkpoints' activation scale: activations are not quantized here (quant_fp8.py)
    # An FP8 checkpoint's per-tensor weight scale covers its projection's rows of the per-row scale.
    per_row = (lambda t, n: t.reshape(1).expand(n)) if parts[-1] == "weight_scale" else None
    if len(parts) >= 2 and parts[-2] in STACKED:
        fused, shard = STACKED[parts[-2]]
        owner = ".".join(parts[:-2])
        module = _submodule(model, owner)
        sizes = getattr(module, "qkv_sizes" if fused == "qkv_proj" else "gate_up_sizes", None)
        if sizes is not None and hasattr(module, fused):
            start, n = sum(sizes[:shard]), sizes[shard]
            return (f"{owner}.{fused}.{parts[-1]}", (slice(start, start + n),),
                    per_row and (lambda t: per_row(t, n)))
    if per_row is not None:
        rows = getattr(_submodule(model, ".".join(parts[:-1])), "out_features", 1)
        return name, None, lambda t: per_row(t, rows)
    return name, None, None


def kv_scale_target(parts: list[str]) -> Target | None:
    """FP8 KV-cache scales: ModelOpt's `self_attn.k_proj.k_scale` and compressed-tensors' `self_attn.k_scale`
    both fill the attention module's `k_scale` (likewise v). A query scale only matters to attention
    that quantizes its queries; ours runs in the compute dtype, so it is skipped."""
    if parts[-1] == "q_scale":
        return None
    owner = parts[:-2] if parts[-2] in ("k_proj", "v_proj") else parts[:-1]
    return ".".join(owner + [parts[-1]]), None, lambda t: t.reshape(())


def _submodule(model, path: str):
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None
