"""An EAGLE3 draft checkpoint's config.json -> `Eagle3Config`, checked against the target (pure).

The layout vLLM loads as `Eagle3LlamaForCausalLM` (architectures `LlamaForCausalLMEagle3`,
`Eagle3LlamaForCausalLM`): one Llama decoder layer (`midlayer.*`) whose attention reads the
concatenation of the token embedding and the fused target features (2 x hidden), `fc` fusing three
target layers' hidden states (3 x target hidden -> hidden), `norm`, `lm_head` over a draft vocabulary
(`draft_vocab_size`) mapped to the target's by `d2t` (target id = draft id + d2t[draft id]).
`eagle_config.eagle_aux_hidden_state_layer_ids` names the three target layers whose *input* hidden
state is tapped; vLLM's default is (2, L // 2, L - 3).
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm_neuron.model.draft_common import read_draft_config

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int  # the target vocabulary the draft was trained for
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: vLLM's default for the target's depth
    raw: dict  # the whole config.json (rotary settings are read from it)

    def aux_layers(self, num_target_layers: int) -> tuple[int, int, int]:
        """The three target layers tapped (their input hidden states), validated against the target depth."""
        ids = self.aux_layer_ids or default_aux_layers(num_target_layers)
        if len(ids) != 3 or any(not isinstance(i, int) or not 0 <= i < num_target_layers for i in ids):
            raise ValueError(f"EAGLE3 draft: eagle_aux_hidden_state_layer_ids={list(ids)} must be three layer "
                             f"indices in 0..{num_target_layers - 1} of the target")
        return tuple(ids)  # type: ignore[return-value]


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default taps: a low, a middle and a high layer."""
    return (2, num_layers // 2, num_layers - 3)


def read_eagle3_config(path: str) -> Eagle3Config:
    """Reads and validates `path`/config.json; every problem is a ValueError naming the field."""
    raw = read_draft_config(path, "EAGLE3")
    where = f"EAGLE3 draft {path!r} config.json"
    archs = raw.get("architectures") or []
    if not any(a in EAGLE3_ARCHITECTURES for a in archs):
        raise ValueError(f"{where}: architectures {archs} is not an EAGLE3 draft; expected one of "
                         f"{list(EAGLE3_ARCHITECTURES)} (the midlayer.* layout vLLM loads)")
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"):
        if not isinstance(raw.get(key), int) or raw[key] <= 0:
            raise ValueError(f"{where}: {key} must be a positive integer, got {raw.get(key)!r}")
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{where}: num_hidden_layers={raw['num_hidden_layers']}; only single-layer EAGLE3 "
                         f"drafts (midlayer.*) are supported")
    h, heads = raw["hidden_size"], raw["num_attention_heads"]
    aux = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return Eagle3Config(
        hidden_size=h, intermediate_size=raw["intermediate_size"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=raw.get("head_dim") or h // heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), vocab_size=raw["vocab_size"],
        draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
        target_hidden_size=raw.get("target_hidden_size") or h,
        aux_layer_ids=tuple(aux) if aux is not None else None, raw=raw)
