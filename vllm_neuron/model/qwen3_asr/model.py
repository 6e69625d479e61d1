"""Qwen3-ASR: the audio encoder (audio.py) and projector, and Qwen3's text decoder.

The runner encodes audio with `encode_audio(mel, chunk_len)` (fixed-shape block inputs, features.py)
outside the text graph and passes the result into a prefill as `forward(..., mm=AudioEmbeds)`: the audio
embeddings replace the `<|audio_pad|>` placeholder rows of the token embeddings. Positions are plain
1-D (no M-RoPE), so decode needs nothing per row. Parameter names equal transformers'
(`model.language_model.*`, `model.audio_tower.*`, `model.multi_modal_projector.*`, `lm_head`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn

from vllm_neuron.model.base import CausalLM, ModelSpec, Target
from vllm_neuron.model.layers.linear import Linear
from vllm_neuron.model.llama.model import LlamaDecoderLayer, LlamaModel
from vllm_neuron.model.llama.weight_loaders import llama_checkpoint_target
from vllm_neuron.model.qwen3_asr.audio import Qwen3ASRAudioEncoder, Qwen3ASRProjector
from vllm_neuron.model.qwen3_asr.config import Qwen3ASRArchConfig


@dataclass
class AudioEmbeds:
    """A prefill's audio inputs (fixed shapes per bucket; zeros and False at text tokens)."""

    embeds: torch.Tensor  # [T, hidden] audio embeddings at placeholder rows
    mask: torch.Tensor  # [T] bool: the rows that take `embeds`


pytree.register_dataclass(AudioEmbeds)


class _Towers(nn.Module):
    """`model.*` of the checkpoint: `language_model` and (unless text only) `audio_tower` and its projector."""

    def __init__(self, arch: Qwen3ASRArchConfig, hf_text_config, language_model_only: bool) -> None:
        super().__init__()
        self.language_model = LlamaModel(arch.text, hf_text_config, LlamaDecoderLayer)
        self.audio_tower = None if language_model_only else Qwen3ASRAudioEncoder(arch.audio)
        self.multi_modal_projector = None if language_model_only else Qwen3ASRProjector(arch.audio)


class Qwen3ASRForConditionalGeneration(CausalLM):
    multimodal = True
    audio = True
    modalities = ("audio",)

    @classmethod
    def spec(cls, hf_config) -> ModelSpec:
        t = Qwen3ASRArchConfig.from_hf(hf_config).text
        return ModelSpec(t.num_layers, t.num_kv_heads, t.head_dim, (None,) * t.num_layers, quantizations=())

    def __init__(self, hf_config, quantization: str | None = None, language_model_only: bool = False) -> None:
        super().__init__()
        self.mm_arch = Qwen3ASRArchConfig.from_hf(hf_config)
        self.arch = self.mm_arch.text  # what the Llama-family loader reads (tied embeddings)
        self.model_spec = self.spec(hf_config)
        self.language_model_only = language_model_only
        self.model = _Towers(self.mm_arch, hf_config.get_text_config(), language_model_only)
        self.lm_head = Linear(self.arch.hidden_size, self.arch.vocab_size, bias=False)
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight

    def encode_audio(self, mel: torch.Tensor, chunk_len: torch.Tensor) -> torch.Tensor:
        """Audio encoder + projector on one block bucket -> [blocks * window_tokens, hidden]."""
        if self.model.audio_tower is None:
            raise ValueError("this engine loaded the text tower only (mm_language_model_only); it cannot encode audio")
        return self.model.multi_modal_projector(self.model.audio_tower(mel, chunk_len))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, kv_caches, meta, mm: AudioEmbeds | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = inputs_embeds
        if mm is not None:
            x = self.embed_input_ids(input_ids) if x is None else x
            x = torch.where(mm.mask[:, None], mm.embeds.to(x.dtype), x)
        return self.model.language_model(input_ids, positions, kv_caches, meta, x)

    def checkpoint_target(self, name: str) -> Target | None:
        if name.startswith(("model.audio_tower.", "model.multi_modal_projector.")):
            return None if self.language_model_only else (name, None, None)
        return llama_checkpoint_target(self, name)
