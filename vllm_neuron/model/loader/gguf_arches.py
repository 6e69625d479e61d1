"""What each GGUF architecture llama.cpp's converter writes differs in: the transformers config and
`architectures` entry it maps to, whether Q/K rows are permuted, tensor names beyond Llama's, tensors that
only configure (rope factors), a shift stored into norm weights, and config fields from its own metadata.

gguf_loader.py builds the common config fields (sizes, heads, rope) and reads the tensors; `config_extra`
gets a metadata reader for the architecture's keys (`meta("attention.scale")` reads `<arch>.attention.scale`),
the tensors that only configure, those common fields and every tensor name, and returns the fields to add
or replace. A layer tensor name with `{e}` is a stack of experts: the loader yields one tensor per expert. A
checkpoint tensor the converter splits in several (`joined_tensors`) is joined back once all its parts are read.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

Meta = Callable[..., Any]  # meta(key without the "<arch>." prefix, default=None)
ConfigExtra = Callable[[Meta, dict[str, np.ndarray], dict[str, Any], set[str]], dict[str, Any]]
Join = Callable[[list[torch.Tensor]], torch.Tensor]  # the parts, in the listed order -> the checkpoint's tensor
Weights = Iterator[tuple[str, torch.Tensor]]


def _no_extra(meta: Meta, tensors: dict[str, np.ndarray], base: dict[str, Any], names: set[str]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class GgufArch:
    config_class: str  # a transformers config class
    architecture: str  # the `architectures` entry (model/registry.py)
    permuted_qk: bool  # llama.cpp's Llama-lineage converters interleave each head's rotary halves
    layer_tensors: dict[str, str] = field(default_factory=dict)  # blk.N.<name> -> model.layers.N.<name>
    config_tensors: frozenset[str] = frozenset()  # read into the config, not parameters
    norm_shift: float = 0.0  # added by the converter to every *norm.weight (Gemma's 1 + w)
    partial_rotary: bool = False  # rope.dimension_count below the head size is a partial_rotary_factor
    latent_heads: bool = False  # key_length / rope.dimension_count describe MLA's heads (config_extra reads them)
    # HF layer suffix -> (the GGUF layer suffixes it was split into, how to join them back)
    joined_tensors: dict[str, tuple[tuple[str, ...], Join]] = field(default_factory=dict)
    packed_mxfp4: bool = False  # MXFP4 tensors come as HF's packed <name>_blocks / <name>_scales, not dequantized
    regroup: Callable[[Weights], Weights] | None = None  # the HF-named stream -> the checkpoint's tensors
    config_extra: ConfigExtra = _no_extra


def _gemma3(meta: Meta, tensors: dict[str, np.ndarray], base: dict[str, Any], names: set[str]) -> dict[str, Any]:
    n, window = base["num_hidden_layers"], meta("attention.sliding_window")
    # llama.cpp's Gemma 3: every 6th layer global unless the file says otherwise (an int, or one bool per
    # layer, True for a sliding layer); local layers rotate with base 10000 unless rope.freq_base_swa is set.
    pattern = meta("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [bool((i + 1) % int(pattern)) for i in range(n)]
    types = ["sliding_attention" if s and window else "full_attention" for s in sliding]
    # The attention scale is 1/sqrt(query_pre_attn_scalar): attention.scale when written, else llama.cpp's
    # rule (the 27B's 62 layers scale by hidden / heads, every other size by the head size).
    scale = meta("attention.scale")
    if scale:
        scalar = float(scale) ** -2
    else:
        scalar = base["hidden_size"] / base["num_attention_heads"] if n == 62 else base["head_dim"]
    local = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base_swa", 10000.0))}
    return dict(layer_types=types, sliding_window=int(window) if window else None, query_pre_attn_scalar=scalar,
                rope_parameters={"full_attention": base["rope_parameters"], "sliding_attention": local},
                final_logit_softcapping=meta("final_logit_softcapping"),
                attn_logit_softcapping=meta("attn_logit_softcapping"), tie_word_embeddings=True)


def _phi3(meta: Meta, tensors: dict[str, np.ndarray], base: dict[str, Any], names: set[str]) -> dict[str, Any]:
    window = meta("attention.sliding_window")
    out: dict[str, Any] = {"sliding_window": int(window) if window else None}  # 0: none (Phi-4)
    if "rope_factors_long.weight" in tensors:
        orig = int(meta("rope.scaling.original_context_length"))
        rope = dict(base["rope_parameters"], rope_type="longrope", original_max_position_embeddings=orig,
                    long_factor=tensors["rope_factors_long.weight"].reshape(-1).tolist(),
                    short_factor=tensors["rope_factors_short.weight"].reshape(-1).tolist())
        out.update(rope_parameters=rope, original_max_position_embeddings=orig)
    return out


def _granite(meta: Meta, tensors: dict[str, np.ndarray], base: dict[str, Any], names: set[str]) -> dict[str, Any]:
    # The converter writes each *_multiplier as a *_scale when non-zero; an absent attention.scale is llama.cpp's
    # 1/sqrt(head_dim).
    return dict(attention_multiplier=float(meta("attention.scale") or base["head_dim"] ** -0.5),
                embedding_multiplier=float(meta("embedding_scale") or 1.0),
                residual_multiplier=float(meta("residual_scale") or 1.0),
                logits_scaling=float(meta("logit_scale") or 1.0))


def _qwen3moe(meta: Meta, tensors: dict[str, np.ndarray], base: dict[str, Any], names: set[str]) -> dict[str, Any]:
    # llama.cpp always renormalises the top-k weights for qwen3moe (every release sets norm_topk_prob).
    dense = [i for i in range(base["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    return dict(num_experts=int(meta("expert_count")), num_experts_per_tok=int(meta("expert_used_count")),
                moe_intermediate_size=int(meta("expert_feed_forward_length")),
                norm_topk_prob=bool(meta("expert_weights_norm", True)), mlp_only_layers=dense, decoder_sparse_step=1)


def _deepseek2(meta: Meta, tensors: dict[str, np.ndarray], base: dict[str, Any], names: set[str]) -> dict[str, Any]:
    # The converter writes MLA as one KV head of the latent: head_count_kv 1, key_length latent + rope (value_length
    # the latent); the per-head sizes are the *_mla keys (files before them: key_length / value_length themselves).
    rope = int(meta("rope.dimension_count"))
    qk = int(meta("attention.key_length_mla") or base["head_dim"])
    v = int(meta("attention.value_length_mla") or meta("attention.value_length"))
    gating = int(meta("expert_gating_func", 1))
    if gating != 1:  # 2: sigmoid (DeepSeek-V3's router, with its score-correction bias)
        raise ValueError(f"deepseek2 GGUF with expert_gating_func={gating} (sigmoid routing, DeepSeek-V3) is not "
                         "supported; supported: 1 (softmax, DeepSeek-V2 / V2-Lite)")
    params = dict(base["rope_parameters"])
    log_mul = meta("rope.scaling.yarn_log_multiplier")
    if params["rope_type"] == "yarn" and log_mul:  # 0.1 * mscale_all_dim; llama.cpp takes mscale as equal
        params["mscale"] = params["mscale_all_dim"] = float(log_mul) / 0.1
    groups = int(meta("expert_group_count") or 1)
    return dict(num_key_value_heads=base["num_attention_heads"], head_dim=rope, rope_parameters=params,
                q_lora_rank=meta("attention.q_lora_rank"), kv_lora_rank=int(meta("attention.kv_lora_rank")),
                qk_nope_head_dim=qk - rope, qk_rope_head_dim=rope, v_head_dim=v,
                n_routed_experts=meta("expert_count"), num_experts_per_tok=meta("expert_used_count"),
                moe_intermediate_size=meta("expert_feed_forward_length"),
                n_shared_experts=int(meta("expert_shared_count", 0)),
                first_k_dense_replace=int(meta("leading_dense_block_count", 0)),
                routed_scaling_factor=float(meta("expert_weights_scale", 1.0)),
                norm_topk_prob=bool(meta("expert_weights_norm", False)),
                topk_method="group_limited_greedy" if groups > 1 else "greedy",
                n_group=groups, topk_group=int(meta("expert_group_used_count") or 1))


def _join_kv_b(parts: list[torch.Tensor]) -> torch.Tensor:
    # The converter stores kv_b_proj [heads * (nope + v), latent] as k_b [heads, latent, nope] (W_UK transposed)
    # and v_b [heads, v, latent].
    k_b, v_b = parts
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).flatten(0, 1).contiguous()


def _gpt_oss(meta: Meta, tensors: dict[str, np.ndarray], base: dict[str, Any], names: set[str]) -> dict[str, Any]:
    # llama.cpp's gpt-oss: sliding and full layers alternate from a sliding first one (a fixed pattern of 2, not in
    # the file), and the clamped SwiGLU takes the checkpoints' constants (alpha 1.702, limit 7).
    n, window = base["num_hidden_layers"], meta("attention.sliding_window")
    rope = dict(base["rope_parameters"])
    if rope["rope_type"] == "yarn":
        rope["truncate"] = False  # every gpt-oss checkpoint's; the converter does not write it
    return dict(num_local_experts=int(meta("expert_count")), num_experts_per_tok=int(meta("expert_used_count")),
                intermediate_size=int(meta("expert_feed_forward_length")), rope_parameters=rope,
                sliding_window=int(window) if window else None, swiglu_limit=7.0,
                layer_types=["sliding_attention" if window and i % 2 == 0 else "full_attention" for i in range(n)])


_GPT_OSS_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(gate|up|down)_proj(_bias|_blocks|_scales|)$")


def _gpt_oss_experts(weights: Weights) -> Weights:
    """The converter's separate gate / up experts (ffn_gate_exps, ffn_up_exps: [E, I, ...] each, and their biases)
    interleaved back into the checkpoint's gate_up_proj rows (gate, up, gate, ...); unquantized experts in
    transformers' [E, in, out] layout, MXFP4 blocks / scales as gpt-oss ships them ([E, out, in / 32, ...])."""
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, t in weights:
        m = _GPT_OSS_EXPERT.match(name)
        if m is None:
            yield name, t
            continue
        prefix, proj, suffix = m.groups()
        if proj == "down":
            yield name, t.transpose(1, 2).contiguous() if suffix == "" else t
            continue
        got = pending.setdefault((prefix, suffix), {})
        got[proj] = t
        if len(got) < 2:
            continue
        del pending[(prefix, suffix)]
        both = torch.stack([got["gate"], got["up"]], dim=2).flatten(1, 2)
        yield f"{prefix}.gate_up_proj{suffix}", both.transpose(1, 2).contiguous() if suffix == "" else both
    if pending:
        raise ValueError(f"GGUF gpt-oss experts without their gate or up half: {sorted(pending)}")


_EXPERTS = {"ffn_gate_inp.weight": "mlp.gate.weight",
            "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
            "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
            "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight"}

GGUF_ARCHES: dict[str, GgufArch] = {
    "llama": GgufArch("LlamaConfig", "LlamaForCausalLM", True,
                      config_extra=lambda meta, tensors, base, names: {"mlp_bias": False}),
    "qwen3": GgufArch("Qwen3Config", "Qwen3ForCausalLM", False),
    "gemma3": GgufArch("Gemma3TextConfig", "Gemma3ForCausalLM", False, norm_shift=1.0, config_extra=_gemma3,
                       layer_tensors={"post_attention_norm.weight": "post_attention_layernorm.weight",
                                      "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}),
    "phi3": GgufArch("Phi3Config", "Phi3ForCausalLM", False, partial_rotary=True, config_extra=_phi3,
                     config_tensors=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"}),
                     layer_tensors={"attn_qkv.weight": "self_attn.qkv_proj.weight",
                                    "ffn_up.weight": "mlp.gate_up_proj.weight"}),  # gate and up, fused
    "granite": GgufArch("GraniteConfig", "GraniteForCausalLM", True, config_extra=_granite),
    "qwen3moe": GgufArch("Qwen3MoeConfig", "Qwen3MoeForCausalLM", False, config_extra=_qwen3moe,
                         layer_tensors=_EXPERTS),
    # llama.cpp rotates deepseek2's rope dims in adjacent pairs, as the checkpoint does: no rows permuted.
    "deepseek2": GgufArch("DeepseekV2Config", "DeepseekV2ForCausalLM", False, latent_heads=True,
                          config_extra=_deepseek2,
                          layer_tensors={**_EXPERTS,
                                         "attn_q_a.weight": "self_attn.q_a_proj.weight",
                                         "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
                                         "attn_q_b.weight": "self_attn.q_b_proj.weight",
                                         "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
                                         "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
                                         "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # converters before 2025
                                         "attn_k_b.weight": "self_attn.kv_b_proj.weight",
                                         "attn_v_b.weight": "self_attn.kv_b_proj.weight",
                                         "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
                                         "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
                                         "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight"},
                          joined_tensors={"self_attn.kv_b_proj.weight": (("attn_k_b.weight", "attn_v_b.weight"),
                                                                         _join_kv_b)}),
    # No rows permuted (llama.cpp rotates gpt-oss in halves, as transformers does); MXFP4 experts stay packed.
    "gpt-oss": GgufArch("GptOssConfig", "GptOssForCausalLM", False, config_extra=_gpt_oss, packed_mxfp4=True,
                        regroup=_gpt_oss_experts,
                        layer_tensors={"post_attention_norm.weight": "post_attention_layernorm.weight",
                                       "attn_sinks.weight": "self_attn.sinks",
                                       "ffn_gate_inp.weight": "mlp.router.weight",
                                       "ffn_gate_inp.bias": "mlp.router.bias",
                                       **{f"ffn_{p}_exps.{kind}": f"mlp.experts.{p}_proj{suffix}"
                                          for p in ("gate", "up", "down")
                                          for kind, suffix in (("weight", ""), ("bias", "_bias"))}}),
}
