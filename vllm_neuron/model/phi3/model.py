"""Phi-3 / Phi-3.5 / Phi-4 mini (Phi3ForCausalLM): Llama's layout with the checkpoint's projections fused.

* `qkv_proj` ([q; k; v] rows) and `gate_up_proj` ([gate; up]) are split into transformers' Llama names at
  load, so the fused parameters fill through Llama's targets (tensor parallelism takes each part's rows);
* `partial_rotary_factor` (Phi-4-mini: 0.75) rotates the first part of each head (layers/rotary.py);
* LongRoPE (`rope_type: longrope`, short/long factors, original_max_position_embeddings): transformers switches
  to the long factors for a whole forward once the sequence passes the original length. A static table cannot
  switch per sequence, so the choice is made once per engine: the long factors when max_model_len exceeds
  original_max_position_embeddings, the short ones otherwise. The result equals transformers' for every
  sequence that stays below the original length on a short engine, and for every prompt already above it on a
  long one; a short prompt on a long engine runs with the long factors (vLLM's choice for long contexts too);
* `sliding_window` (Phi-3-mini-4k: 2047) below max_position_embeddings applies to every layer (KV cache groups).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from vllm_neuron.model.layers.rotary import RotaryEmbedding, rope_parameters
from vllm_neuron.model.llama.config import LlamaArchConfig
from vllm_neuron.model.llama.model import LlamaForCausalLM
from vllm_neuron.model.mistral.model import MistralArchConfig, MistralDecoderLayer


def uses_long_factors(hf_config, max_model_len: int | None) -> bool:
    """LongRoPE's long factors serve an engine whose context reaches past the original length."""
    params = rope_parameters(hf_config)
    if params.get("rope_type") != "longrope":
        return False
    return (max_model_len or hf_config.max_position_embeddings) > params["original_max_position_embeddings"]


def unfused_tensors(weights: Iterable[tuple[str, torch.Tensor]], cfg: LlamaArchConfig
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3's fused qkv_proj / gate_up_proj tensors as the Llama q/k/v and gate/up tensors they stack."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name, t in weights:
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name[:-len("qkv_proj.weight")]
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                yield f"{base}{part}.weight", piece
        elif name.endswith("mlp.gate_up_proj.weight"):
            base = name[:-len("gate_up_proj.weight")]
            gate, up = t.chunk(2)
            yield f"{base}gate_proj.weight", gate
            yield f"{base}up_proj.weight", up
        else:
            yield name, t


class Phi3ForCausalLM(LlamaForCausalLM):
    layer_cls = MistralDecoderLayer  # Llama's layer with an optional window per layer
    takes_max_model_len = True  # the engine passes max_model_len (LongRoPE's factor set)
    takes_lora = False  # model/layers/lora.py refuses enable_lora

    @classmethod
    def arch_config(cls, hf_config) -> MistralArchConfig:
        return MistralArchConfig.from_hf(hf_config, family="Phi3")

    def __init__(self, hf_config, quantization: str | None = None, max_model_len: int | None = None) -> None:
        super().__init__(hf_config, quantization)
        if uses_long_factors(hf_config, max_model_len):
            self.model.rotary = RotaryEmbedding(hf_config, self.arch.max_position_embeddings, long_factors=True)

    def load_weights(self, weights) -> int:
        return super().load_weights(unfused_tensors(weights, self.arch))
