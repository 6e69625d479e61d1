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
    "deepseek_v2": {"mlp.gate.weight": "ffn_gate_inp.weight",
                    "self_attn.q_a_proj.weight": "attn_q_a.weight",
                    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
                    "self_attn.q_b_proj.weight": "attn_q_b.weight",
                    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
                    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
                    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",  # the converters before the k_b / v_b split
                    **{f"mlp.shared_experts.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")}},
}
# The factory's arch (transformers' model_type) -> llama.cpp's name
_GGUF_ARCH = {"qwen3_moe": "qwen3moe", "deepseek_v2": "deepseek2", "gpt_oss": "gpt-oss"}


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


def _deepseek_v2_metadata(w, cfg) -> None:
    import gguf

    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    # MLA as the converter writes it: one KV head of latent + rope dims, the per-head sizes as the *_mla keys.
    for key, value in (("kv_lora_rank", cfg.kv_lora_rank), ("q_lora_rank", cfg.q_lora_rank),
                       ("key_length", cfg.kv_lora_rank + cfg.qk_rope_head_dim), ("value_length", cfg.kv_lora_rank),
                       ("key_length_mla", cfg.qk_nope_head_dim + cfg.qk_rope_head_dim),
                       ("value_length_mla", cfg.v_head_dim), ("rope_dimension_count", cfg.qk_rope_head_dim),
                       ("leading_dense_block_count", cfg.first_k_dense_replace),
                       ("expert_count", cfg.n_routed_experts), ("expert_used_count", cfg.num_experts_per_tok),
                       ("expert_feed_forward_length", cfg.moe_intermediate_size),
                       ("expert_shared_count", cfg.n_shared_experts),
                       ("expert_weights_scale", cfg.routed_scaling_factor)):
        if value is not None:  # q_lora_rank: None for V2-Lite
            getattr(w, f"add_{key}")(value)
    if getattr(cfg, "scoring_func", None):  # the checkpoints' router function (transformers' config drops it)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType[cfg.scoring_func.upper()])
    if cfg.n_group:
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _deepseek_v2_kv_b(name: str, arr: np.ndarray, cfg) -> list[tuple[str, np.ndarray]]:
    """kv_b_proj as today's converter splits it: k_b [heads, latent, nope] (transposed) and v_b [heads, v, latent]."""
    layer = name.split(".")[2]
    kv_b = arr.reshape(cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    k_b, v_b = kv_b[:, :cfg.qk_nope_head_dim], kv_b[:, cfg.qk_nope_head_dim:]
    return [(f"blk.{layer}.attn_k_b.weight", k_b.transpose(0, 2, 1)), (f"blk.{layer}.attn_v_b.weight", v_b)]


def _qwen3_moe_experts(name: str, arr: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """transformers' stacked experts as the converter stacks the checkpoint's per-expert tensors."""
    layer = name.split(".")[2]
    if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
        gate, up = np.split(arr, 2, axis=1)
        return [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
    return [(f"blk.{layer}.ffn_down_exps.weight", arr)]  # [E, H, I]


_METADATA = {"gemma3": _gemma3_metadata, "phi3": _phi3_metadata, "granite": _granite_metadata,
             "qwen3_moe": _qwen3_moe_metadata, "deepseek_v2": _deepseek_v2_metadata}


def make_family_gguf(path: str, arch: str, *, seed: int = 0, quant: str | None = None, tokenizer: bool = False,
                     split_kv_b: bool = True, **config_kwargs: Any):
    """(file, the transformers model it holds): build_tiny_model(arch, seed=seed, **config_kwargs) written as
    llama.cpp's converter writes `arch`; matrices F32 or, with `quant` (e.g. "Q8_0"), quantized; `tokenizer`
    adds the SmolLM2 tokenizer (an engine can then serve the file; parsing it takes seconds). `split_kv_b=False`
    writes DeepSeek-V2's kv_b_proj whole (attn_kv_b), as the converters before its k_b / v_b split did."""
    import copy

    import gguf

    model = build_tiny_model(arch, seed=seed, **config_kwargs)
    cfg = model.config
    sizes = copy.copy(cfg)
    if arch == "deepseek_v2":
        sizes.num_key_value_heads = 1  # the converter writes MLA as multi-query attention over the latent
    w = gguf_writer_with_sizes(path, _GGUF_ARCH.get(arch, arch), sizes)
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
        if ".mlp.experts." in name:
            named = _qwen3_moe_experts(name, arr)  # DeepSeek-V2's experts are stacked the same way
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            named = _deepseek_v2_kv_b(name, arr, cfg)
        else:
            named = [(_gguf_tensor_name(name, arch), arr)]
        for gguf_name, a in named:
            a = np.ascontiguousarray(a, dtype=np.float32)
            if quant is not None and a.ndim >= 2:
                qtype = gguf.GGMLQuantizationType[quant]
                w.add_tensor(gguf_name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(gguf_name, a)
    write_gguf(w)
    return path, model


def _ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF's packed MXFP4 ([..., G, 16] with elements 2j, 2j + 1 in byte j) as GGML's blocks of 17 bytes (the scale
    byte, then element j in byte j's low nibble and j + 16 in its high one), [..., G * 17]."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*scales.shape[:-1], -1).astype(np.uint8)


def make_gpt_oss_gguf(path: str, *, seed: int = 0, tokenizer: bool = False, mxfp4: bool = True,
                      **config_kwargs: Any):
    """(file, the transformers gpt-oss it holds, its experts' packed MXFP4 {param name: (blocks, scales)}):
    build_tiny_gpt_oss_mxfp4(seed=seed, **config_kwargs) as llama.cpp's
    converter writes `gpt-oss`: the MXFP4 experts repacked to GGML's MXFP4 blocks and split into gate / up halves
    (the checkpoint interleaves their rows), biases likewise, attention sinks as `attn_sinks`, the rest F32;
    `tokenizer`: make_family_gguf's; `mxfp4=False` writes the experts F32, as the converter does a bf16 checkpoint's."""
    import gguf

    from tests.model_factory import build_tiny_gpt_oss_mxfp4

    model, packed = build_tiny_gpt_oss_mxfp4(seed=seed, **config_kwargs)
    cfg, rope = model.config, model.config.rope_parameters
    w = gguf_writer_with_sizes(path, "gpt-oss", cfg)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    for key, value in (("key_length", cfg.head_dim), ("value_length", cfg.head_dim),
                       ("rope_freq_base", rope["rope_theta"]), ("expert_count", cfg.num_local_experts),
                       ("expert_used_count", cfg.num_experts_per_tok), ("sliding_window", cfg.sliding_window),
                       ("expert_feed_forward_length", cfg.intermediate_size),
                       ("rope_scaling_type", gguf.RopeScalingType.YARN), ("rope_scaling_factor", rope["factor"]),
                       ("rope_scaling_orig_ctx_len", rope["original_max_position_embeddings"]),
                       ("rope_scaling_yarn_beta_fast", rope["beta_fast"]),
                       ("rope_scaling_yarn_beta_slow", rope["beta_slow"])):
        getattr(w, f"add_{key}")(value)
    if tokenizer:
        add_smollm2_tokenizer(w)
    names = {"post_attention_layernorm.weight": "post_attention_norm.weight", "self_attn.sinks": "attn_sinks.weight",
             "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
             **{f"self_attn.{p}_proj.bias": f"attn_{g}.bias"
                for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))}}
    for name, t in model.state_dict().items():
        arr = t.detach().float().numpy()
        if ".mlp.experts." not in name:
            gguf_name = _HF_TO_GGUF_GLOBAL.get(name) or f"blk.{name.split('.')[2]}." + (
                names.get(name.split(".", 3)[3]) or _HF_TO_GGUF_LAYER[name.split(".", 3)[3]])
            w.add_tensor(gguf_name, np.ascontiguousarray(arr, dtype=np.float32))
            continue
        layer, proj = name.split(".")[2], name.split(".")[-1]
        if proj == "down_proj_bias":
            w.add_tensor(f"blk.{layer}.ffn_down_exps.bias", arr)
        elif proj == "gate_up_proj_bias":  # rows interleaved gate, up, gate, ...
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.bias", np.ascontiguousarray(arr[:, 0::2]))
            w.add_tensor(f"blk.{layer}.ffn_up_exps.bias", np.ascontiguousarray(arr[:, 1::2]))
        elif not mxfp4:  # transformers' [E, in, out] transposed to [E, out, in]
            out = np.ascontiguousarray(arr.transpose(0, 2, 1))
            halves = [("down", out)] if proj == "down_proj" else [("gate", out[:, 0::2]), ("up", out[:, 1::2])]
            for half, a in halves:
                w.add_tensor(f"blk.{layer}.ffn_{half}_exps.weight", np.ascontiguousarray(a))
        else:
            blocks, scales = (x.numpy() for x in packed[name])  # [E, out, G, 16], [E, out, G]
            halves = [("down", blocks, scales)] if proj == "down_proj" else \
                [("gate", blocks[:, 0::2], scales[:, 0::2]), ("up", blocks[:, 1::2], scales[:, 1::2])]
            for half, b, s in halves:
                w.add_tensor(f"blk.{layer}.ffn_{half}_exps.weight", _ggml_mxfp4(b, s),
                             raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    write_gguf(w)
    return path, model, packed
