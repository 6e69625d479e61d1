"""Typed views of a Hugging Face Qwen3-VL config: the text tower (Qwen3's), the vision tower, the
placeholder token ids and the M-RoPE sections."""
from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_neuron.model.llama.config import LlamaArchConfig


@dataclass(frozen=True)
class VisionArchConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    hidden_act: str
    rope_theta: float

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: channels x temporal x patch x patch (the processor's rows)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one text token."""
        return self.spatial_merge_size ** 2

    @classmethod
    def from_hf(cls, v) -> "VisionArchConfig":
        for key in ("patch_size", "temporal_patch_size"):
            if not isinstance(getattr(v, key), int):
                raise ValueError(f"vision_config.{key}={getattr(v, key)!r} is not supported; supported: one integer")
        rope = getattr(v, "rope_parameters", None) or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config rope_type={rope.get('rope_type')!r} is not supported; supported: ['axial']")
        return cls(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                   num_heads=v.num_heads, in_channels=v.in_channels, patch_size=v.patch_size,
                   temporal_patch_size=v.temporal_patch_size, spatial_merge_size=v.spatial_merge_size,
                   out_hidden_size=v.out_hidden_size, num_position_embeddings=v.num_position_embeddings,
                   deepstack_visual_indexes=tuple(v.deepstack_visual_indexes), hidden_act=v.hidden_act,
                   rope_theta=float(rope.get("rope_theta", 10000.0)))


@dataclass(frozen=True)
class Qwen3VLArchConfig:
    text: LlamaArchConfig
    vision: VisionArchConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    # Rotary frequencies per axis (temporal, height, width), interleaved as transformers' Qwen3-VL does.
    mrope_section: tuple[int, int, int]
    rope_theta: float

    @classmethod
    def from_hf(cls, hf) -> "Qwen3VLArchConfig":
        t = hf.get_text_config()
        if getattr(t, "use_sliding_window", False):
            raise ValueError("Qwen3-VL with use_sliding_window=true is not supported; supported: use_sliding_window=false")
        rope = dict(getattr(t, "rope_parameters", None) or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"Qwen3-VL text rope_type={rope.get('rope_type')!r} is not supported; supported: "
                             "['default'] (M-RoPE)")
        if rope.get("rope_theta") is None:
            raise ValueError("the Qwen3-VL text config has no rope_theta; refusing to guess a RoPE base")
        text = LlamaArchConfig.from_hf(t, family="Qwen3-VL", qk_norm=True)
        # The output layer is tied at the top level of a composite config.
        text = replace(text, tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)))
        section = tuple(rope.get("mrope_section") or (24, 20, 20))
        if len(section) != 3 or sum(section) != text.head_dim // 2:
            raise ValueError(f"mrope_section={list(section)} must have 3 entries summing to head_dim/2 "
                             f"({text.head_dim // 2})")
        vision = VisionArchConfig.from_hf(hf.vision_config)
        if vision.out_hidden_size != text.hidden_size:
            raise ValueError(f"vision_config.out_hidden_size={vision.out_hidden_size} must equal the text "
                             f"hidden_size={text.hidden_size}")
        return cls(text=text, vision=vision, image_token_id=hf.image_token_id, video_token_id=hf.video_token_id,
                   vision_start_token_id=hf.vision_start_token_id, vision_end_token_id=hf.vision_end_token_id,
                   mrope_section=section, rope_theta=float(rope["rope_theta"]))

