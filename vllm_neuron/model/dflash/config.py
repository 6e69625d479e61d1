"""A DFlash draft checkpoint's config.json -> `DFlashConfig` (pure).

Two layouts, as vLLM reads them:
* z-lab's / vLLM's own (`architectures` `DFlashDraftModel`): Qwen3 fields at the top level, `block_size`,
  `dflash_config.mask_token_id` and `dflash_config.target_layer_ids` - indices of target layers whose
  *output* is tapped (vLLM adds 1 to read them as layer inputs) - or `eagle_aux_hidden_state_layer_ids`
  (layer inputs, taking precedence).
* speculators' (`speculators_model_type` "dflash"): the Qwen3 fields under `transformer_layer_config`,
  `aux_hidden_state_layer_ids` (layer inputs), `mask_token_id`, `block_size`, `draft_vocab_size`,
  `target_hidden_size`.
Tap index L (the target's depth) is the last layer's output before the final norm.
Variants vLLM also serves (sliding-window or causal draft layers, attention biases or sinks, Domino
projectors, sample-from-anchor blocks) are refused naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_neuron.model.draft_common import read_draft_config

DFLASH_ARCHITECTURES = ("DFlashDraftModel", "DFlashQwen3ForCausalLM")


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    mask_token_id: int
    block_size: int | None
    aux_layer_ids: tuple[int, ...]  # target layers whose input hidden state is tapped
    num_target_layers: int | None
    rope: dict  # rope_theta / rope_scaling / ... for the rotary table
    raw: dict

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The taps, validated against the target's depth."""
        if self.num_target_layers is not None and self.num_target_layers != num_target_layers:
            raise ValueError(f"DFlash draft: trained on a target of {self.num_target_layers} layers "
                             f"(num_target_layers), the target has {num_target_layers}")
        if any(not 0 <= i <= num_target_layers for i in self.aux_layer_ids):
            raise ValueError(f"DFlash draft: target layer taps {list(self.aux_layer_ids)} (as layer inputs) must lie "
                             f"in 0..{num_target_layers} for a target of {num_target_layers} layers")
        return self.aux_layer_ids


def _refuse_variants(raw: dict, dflash: dict, where: str) -> None:
    checks = [
        ("layer_types", "sliding_attention" in (raw.get("layer_types") or []), "sliding-window draft layers"),
        ("dflash_config.use_swa", bool(dflash.get("use_swa")), "sliding-window draft layers"),
        ("is_causal", bool(raw.get("is_causal")), "causal draft layers"),
        ("dflash_config.causal", bool(dflash.get("causal")), "causal draft layers"),
        ("attention_bias", bool(raw.get("attention_bias")), "attention biases"),
        ("dflash_config.attention_sink_bias", bool(dflash.get("attention_sink_bias")), "attention sinks"),
        ("is_neox_style", raw.get("is_neox_style", True) is False, "interleaved RoPE"),
        ("projector_type", raw.get("projector_type", "dflash") != "dflash", "the Domino projector"),
        ("sample_from_anchor", bool(raw.get("sample_from_anchor")), "sample-from-anchor blocks"),
    ]
    for field, bad, what in checks:
        if bad:
            raise ValueError(f"{where}: {field} asks for {what}, which vllm-neuron's DFlash drafter does not support "
                             f"yet (supported: non-causal full-attention Qwen3-style draft layers)")


def read_dflash_config(path: str) -> DFlashConfig:
    """Reads and validates `path`/config.json; every problem is a ValueError naming the field."""
    top = read_draft_config(path, "DFlash")
    where = f"DFlash draft {path!r} config.json"
    if top.get("speculators_model_type") is not None:
        if top["speculators_model_type"] != "dflash":
            raise ValueError(f"{where}: speculators_model_type={top['speculators_model_type']!r} is not 'dflash'")
        raw = {**(top.get("transformer_layer_config") or {}),
               **{k: top[k] for k in ("projector_type", "sample_from_anchor") if k in top}}
        dflash = {}
        aux = top.get("aux_hidden_state_layer_ids")
        mask, block = top.get("mask_token_id"), top.get("block_size")
        draft_vocab, target_hidden = top.get("draft_vocab_size"), top.get("target_hidden_size")
        aux_field = "aux_hidden_state_layer_ids"
    else:
        archs = top.get("architectures") or []
        if not any(a in DFLASH_ARCHITECTURES for a in archs):
            raise ValueError(f"{where}: architectures {archs} is not a DFlash draft; expected one of "
                             f"{list(DFLASH_ARCHITECTURES)} or a speculators config (speculators_model_type 'dflash')")
        raw, dflash = top, top.get("dflash_config") or {}
        aux = top.get("eagle_aux_hidden_state_layer_ids")
        aux_field = "eagle_aux_hidden_state_layer_ids"
        if not aux and dflash.get("target_layer_ids"):
            aux, aux_field = [i + 1 for i in dflash["target_layer_ids"]], "dflash_config.target_layer_ids"
        mask = dflash.get("mask_token_id", top.get("mask_token_id"))
        block, draft_vocab, target_hidden = top.get("block_size"), top.get("draft_vocab_size"), \
            top.get("target_hidden_size")
    _refuse_variants(raw, dflash, where)
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
        if not isinstance(raw.get(key), int) or raw[key] <= 0:
            raise ValueError(f"{where}: {key} must be a positive integer, got {raw.get(key)!r}")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) for i in aux):
        raise ValueError(f"{where}: the target layers to tap are missing: set dflash_config.target_layer_ids, "
                         f"eagle_aux_hidden_state_layer_ids or (speculators) aux_hidden_state_layer_ids; got {aux!r} "
                         f"for {aux_field}")
    if not isinstance(mask, int) or isinstance(mask, bool) or mask < 0:
        raise ValueError(f"{where}: mask_token_id (the id whose embedding fills the block's masked positions) must "
                         f"be a non-negative integer, got {mask!r}")
    if block is not None and (not isinstance(block, int) or block < 2):
        raise ValueError(f"{where}: block_size must be an integer >= 2, got {block!r}")
    h, heads = raw["hidden_size"], raw["num_attention_heads"]
    rope = {k: v for k, v in raw.items() if k.startswith("rope")}
    rope.setdefault("rope_theta", 1000000.0)  # vLLM's default for DFlash drafts (Qwen3's)
    return DFlashConfig(
        hidden_size=h, intermediate_size=raw["intermediate_size"], num_layers=raw["num_hidden_layers"],
        num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or h // heads, rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        vocab_size=raw["vocab_size"], draft_vocab_size=draft_vocab or raw["vocab_size"],
        target_hidden_size=target_hidden or h, mask_token_id=mask, block_size=block, aux_layer_ids=tuple(aux),
        num_target_layers=top.get("num_target_layers"), rope=rope, raw=top)
