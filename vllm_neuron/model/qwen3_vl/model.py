"""Qwen3-VL (dense): the Qwen3 text tower with M-RoPE and deepstack, plus the vision tower (vision.py).

The runner encodes images with `encode(...)` (vision.py's fixed-shape inputs) outside the text graph and
passes the results into a prefill as `forward(..., mm=MultimodalEmbeds)`: the vision embeddings go to the
placeholder positions (`embed`, the inputs_embeds path), the [3, N] M-RoPE positions rotate, and the
deepstack features [D, N, hidden] are added after the first D decoder layers (zero rows at text tokens, so
text is untouched). A decode or verification row takes `forward(..., rope_delta=[N])`: its sequential
position plus its request's M-RoPE delta, on all three axes. Parameter names equal transformers' (`model.language_model.*`,
`model.visual.*`, `lm_head`). `language_model_only` builds the text tower alone (vision tensors skipped).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn

from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.model.base import CausalLM, ModelSpec, Target
from vllm_neuron.model.layers.linear import Linear
from vllm_neuron.model.layers.norm import RMSNorm
from vllm_neuron.model.layers.parallel import VocabParallelEmbedding, gather_last_dim, mark_split, tp_world
from vllm_neuron.model.llama.model import LlamaDecoderLayer, LlamaModel
from vllm_neuron.model.llama.weight_loaders import llama_checkpoint_target
from vllm_neuron.model.qwen3_vl.config import Qwen3VLArchConfig
from vllm_neuron.model.qwen3_vl.vision import Qwen3VLVisionModel
from vllm_neuron.model.qwen3_vl.vision_parallel import VisionParallel, shard_vision_tensor


@dataclass
class MultimodalEmbeds:
    """A prefill's multimodal inputs (fixed shapes per bucket; zeros and False at text tokens)."""

    rope_positions: torch.Tensor  # [3, T] M-RoPE positions
    embeds: torch.Tensor  # [T, hidden] vision embeddings at placeholder rows
    mask: torch.Tensor  # [T] bool: the rows that take `embeds`
    deepstack: torch.Tensor  # [D, T, hidden]


pytree.register_dataclass(MultimodalEmbeds)


class MRotaryEmbedding(nn.Module):
    """Rotary cos/sin from [3, N] positions: frequency i rotates by the temporal, height or width position
    as transformers' interleaved Qwen3-VL layout assigns it (T everywhere except H at 1, 4, .. < 3*sec[1]
    and W at 2, 5, .. < 3*sec[2])."""

    def __init__(self, head_dim: int, theta: float, section: tuple[int, int, int]) -> None:
        super().__init__()
        half = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        axis = torch.zeros(half, dtype=torch.long)
        axis[1:3 * section[1]:3] = 1
        axis[2:3 * section[2]:3] = 2
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions[self.axis].float()  # [half, N]: each frequency's own axis
        freqs = pos.t() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Qwen3VLTextModel(LlamaModel):
    def __init__(self, arch: Qwen3VLArchConfig) -> None:
        nn.Module.__init__(self)
        cfg = arch.text
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = MRotaryEmbedding(cfg.head_dim, arch.rope_theta, arch.mrope_section)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds=None, deepstack=None) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if positions.dim() == 1:  # text only: the three axes agree
            positions = positions[None].expand(3, -1)
        cos, sin = self.rotary(positions, x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, cos, sin, kv_cache, meta)
            if deepstack is not None and i < deepstack.shape[0]:
                x = x + deepstack[i].to(x.dtype)
        return self.norm(x)


class _Towers(nn.Module):
    """`model.*` of the checkpoint: `language_model` and (unless text only) `visual`."""

    def __init__(self, arch: Qwen3VLArchConfig, language_model_only: bool, vp: VisionParallel) -> None:
        super().__init__()
        self.language_model = Qwen3VLTextModel(arch)
        self.visual = None if language_model_only else Qwen3VLVisionModel(arch.vision, vp)


class Qwen3VLForConditionalGeneration(CausalLM):
    multimodal = True
    takes_encoder_parallel = True  # built with its vision tower's TP / DP place (vision_parallel.py)

    @classmethod
    def spec(cls, hf_config) -> ModelSpec:
        t = Qwen3VLArchConfig.from_hf(hf_config).text
        return ModelSpec(t.num_layers, t.num_kv_heads, t.head_dim, (None,) * t.num_layers, quantizations=())

    def __init__(self, hf_config, quantization: str | None = None, language_model_only: bool = False,
                 encoder_parallel: VisionParallel = VisionParallel()) -> None:
        """`encoder_parallel`: the vision tower's TP / DP place and groups (vision_parallel.py)."""
        super().__init__()
        self.encoder_parallel = encoder_parallel
        self.mm_arch = Qwen3VLArchConfig.from_hf(hf_config)
        self.arch = self.mm_arch.text  # what the Llama-family loader reads (tied embeddings)
        self.model_spec = self.spec(hf_config)
        self.language_model_only = language_model_only
        self.model = _Towers(self.mm_arch, language_model_only, encoder_parallel)
        # Split over the vocabulary like the embedding (layers/parallel.py); logits gathered in compute_logits.
        self.lm_head = Linear(self.arch.hidden_size, self.model.language_model.embed_tokens.local_vocab, bias=False)
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.language_model.embed_tokens.weight
        elif tp_world() > 1:
            mark_split(self.lm_head.weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_last_dim(self.lm_head(hidden), self.arch.vocab_size)

    def kv_cache_spec(self) -> tuple[int, int, int]:
        s = self.model_spec
        return s.num_layers, ps.local_kv_heads(s.num_kv_heads, tp_world()), s.head_dim

    @property
    def num_deepstack(self) -> int:
        return len(self.mm_arch.vision.deepstack_visual_indexes)

    def encode(self, pixels, interp_idx, interp_w, rot_pos, segment) -> tuple[torch.Tensor, torch.Tensor]:
        """Vision tower on fixed-shape inputs (preprocessing.VisionInputs) -> (embeds, deepstack)."""
        if self.model.visual is None:
            raise ValueError("this engine loaded the text tower only (mm_language_model_only); it cannot encode media")
        return self.model.visual(pixels, interp_idx, interp_w, rot_pos, segment)

    def embed(self, input_ids, mm_embeds=None, mm_mask=None) -> torch.Tensor:
        x = self.model.language_model.embed_tokens(input_ids)
        if mm_embeds is None:
            return x
        return torch.where(mm_mask[:, None], mm_embeds.to(x.dtype), x)

    def forward(self, input_ids, positions, kv_caches, meta, mm: MultimodalEmbeds | None = None,
                rope_delta: torch.Tensor | None = None) -> torch.Tensor:
        """positions: [N] sequential positions (attention reads them from `meta`); rotary positions come from
        `mm` (a prefill) or are positions + `rope_delta` (decode, verification; text-only steps: positions)."""
        if mm is not None:
            x = self.embed(input_ids, mm.embeds, mm.mask)
            return self.model.language_model(input_ids, mm.rope_positions, kv_caches, meta, x, mm.deepstack)
        rope = positions if rope_delta is None else positions + rope_delta
        return self.model.language_model(input_ids, rope, kv_caches, meta)

    def checkpoint_target(self, name: str) -> Target | None:
        if name.startswith("model.visual."):
            if self.language_model_only:
                return None
            if name.endswith("patch_embed.proj.weight"):
                return name, None, lambda t: t.reshape(t.shape[0], -1)
            return name, None, lambda t: shard_vision_tensor(name, t, self.encoder_parallel,
                                                             self.mm_arch.vision.num_heads)
        return llama_checkpoint_target(self, name)
