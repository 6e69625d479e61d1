"""Tiny GGUF files of the families issue 52 added (gemma3, phi3, granite, qwen3moe), written the way llama.cpp's
convert_hf_to_gguf.py writes each one (names, fused tensors, norm shift, metadata keys), from the very
transformers model build_tiny_model(arch, ...) returns. Written independently of the loader's maps
(model/loader/gguf_arches.py) so that tests check them. By default no tokenizer (the file opens in milliseconds)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from tests.model_factory import (_HF_TO_GGUF_GLOBAL, _HF_TO_GGUF_LAYER, _llamacpp_permute, add_smollm2_tokenizer,
                                 build_tiny_model, gguf_writer_with_sizes, write_gguf)

# Per architecture: HF layer suffix -> llama.cpp's, where it differs from Llama's.
_LAYER_NAMES = {
    "gemma3": {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "granite": {},
    "qwen3_moe": {"mlp.gate.weight": "ffn_gate_inp.weight"},
}
_GGUF_ARCH = {"qwen3_moe": "qwen3moe"}  # the factory's arch (transformers' model_type) -> llama.cpp's name


def _gguf_tensor_name(hf_name: str, arch: str) -> str:
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    _, _, idx, rest = hf_name.split(".", 3)
    return f"blk.{idx}.{_LAYER_NAMES[arch].get(rest) or _HF_TO_GGUF_LAYER[rest]}"


def _gemma3_metadata(w, cfg) -> None:
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_sliding_window(cfg.sliding_window)
    default = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(cfg.num_hidden_layers)]
    if cfg.layer_types != default:  # llama.cpp's converter leaves Gemma 3's every-6th pattern implicit
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])


def _phi3_metadata(w, cfg) -> None:
    rope = cfg.rope_parameters
    rope_dims = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // cfg.num_attention_heads
    orig = rope["original_max_position_embeddings"]
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_sliding_window(cfg.sliding_window or 0)
    if rope.get("long_factor"):
        scale = cfg.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _granite_metadata(w, cfg) -> None:
    # The converter's names: each *_multiplier (and logits_scaling) as a *_scale.
    for key, value in (("attention_scale", cfg.attention_multiplier), ("embedding_scale", cfg.embedding_multiplier),
                       ("residual_scale", cfg.residual_multiplier), ("logit_scale", cfg.logits_scaling),
                       ("rope_freq_base", cfg.rope_parameters["rope_theta"])):
        getattr(w, f"add_{key}")(value)


def _qwen3_moe_metadata(w, cfg) -> None:
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _qwen3_moe_experts(name: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """transformers' stacked experts as the converter stacks the checkpoint's per-expert tensors."""
    layer = name.split(".")[2]
    if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
        gate, up = np.split(arr, 2, axis=1)
        return [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
    return [(f"blk.{layer}.ffn_down_exps.weight", arr)]  # [E, H, I]


_METADATA = {"gemma3": _gemma3_metadata, "phi3": _phi3_metadata, "granite": _granite_metadata,
             "qwen3_moe": _qwen3_moe_metadata}


def make_family_gguf(path: str, arch: str, *, seed: int = 0, quant: str | None = None, tokenizer: bool = False,
                     **config_kwargs: Any):
    """(file, the transformers model it holds): build_tiny_model(arch, seed=seed, **config_kwargs) written as
    llama.cpp's converter writes `arch`; matrices F32 or, with `quant` (e.g. "Q8_0"), quantized; `tokenizer`
    adds the SmolLM2 tokenizer (an engine can then serve the file; parsing it takes seconds)."""
    import gguf

    model = build_tiny_model(arch, seed=seed, **config_kwargs)
    cfg = model.config
    w = gguf_writer_with_sizes(path, _GGUF_ARCH.get(arch, arch), cfg)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    _METADATA[arch](w, cfg)
    if tokenizer:
        add_smollm2_tokenizer(w)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr + 1.0  # the converter stores Gemma's 1 + w
        if arch == "granite" and name.endswith("q_proj.weight"):  # Llama lineage: Q/K rows interleaved
            arr = _llamacpp_permute(arr, cfg.num_attention_heads)
        elif arch == "granite" and name.endswith("k_proj.weight"):
            arr = _llamacpp_permute(arr, cfg.num_key_value_heads)
        named = _qwen3_moe_experts(name, arr) if ".mlp.experts." in name else [(_gguf_tensor_name(name, arch), arr)]
        for gguf_name, a in named:
            a = np.ascontiguousarray(a, dtype=np.float32)
            if quant is not None and a.ndim >= 2:
                qtype = gguf.GGMLQuantizationType[quant]
                w.add_tensor(gguf_name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(gguf_name, a)
    write_gguf(w)
    return path, model
