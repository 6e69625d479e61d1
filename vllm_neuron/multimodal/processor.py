"""Prompt + media -> prompt tokens with expanded placeholders and the items the engine encodes.

Qwen3-VL's way (the only multimodal family so far): the prompt holds one `<|image_pad|>` token per
image (the chat template writes `<|vision_start|><|image_pad|><|vision_end|>`); each is expanded to
the image's t*h*w / merge^2 tokens. Pixels come from transformers' own image processor for the model
(`Qwen2VLImageProcessorPil`: the PIL backend, since the default one needs torchvision, which has no
build for the CPU torch), configured by the checkpoint's preprocessor_config.json and
`mm_processor_kwargs`.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from vllm_neuron.multimodal.inputs import MultiModalItem, media_hash
from vllm_neuron.multimodal.media import load_image

MODALITIES = ("image", "video")


def _processor_keys() -> set[str]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorKwargs

    return set(Qwen2VLImageProcessorKwargs.__annotations__) | {"min_pixels", "max_pixels"}


class MultiModalProcessor:
    def __init__(self, hf_config, model_path: str, *, mm_processor_kwargs: Mapping[str, Any] | None = None,
                 limits: Mapping[str, int] | None = None, allowed_local_media_path: str | None = None,
                 language_model_only: bool = False, max_frame_patches: int | None = None) -> None:
        self.image_token_id = hf_config.image_token_id
        self.video_token_id = hf_config.video_token_id
        self.merge = hf_config.vision_config.spatial_merge_size
        self.model_path = model_path
        self.limits = dict(limits or {})
        self.allowed_local_media_path = allowed_local_media_path
        self.language_model_only = language_model_only
        self.max_frame_patches = max_frame_patches  # encoder_attention_block_size: a frame must fit a block
        self.default_kwargs = self.check_kwargs(mm_processor_kwargs or {})

    @staticmethod
    def check_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(kwargs) - _processor_keys())
        if unknown:
            raise ValueError(f"mm_processor_kwargs has unknown key(s) {unknown}; valid keys: {sorted(_processor_keys())}")
        return dict(kwargs)

    @functools.lru_cache(maxsize=8)
    def _image_processor(self, kwargs_json: str):
        from transformers import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil.from_pretrained(self.model_path, **json.loads(kwargs_json))

    def image_processor(self, overrides: Mapping[str, Any] | None = None):
        kwargs = {**self.default_kwargs, **self.check_kwargs(overrides or {})}
        return self._image_processor(json.dumps(kwargs, sort_keys=True))

    def count_items(self, mm_data: Mapping[str, Any]) -> dict[str, list]:
        """{modality: [items]} after validating modalities and the per-prompt limits."""
        out = {}
        for modality, value in mm_data.items():
            if modality not in MODALITIES:
                raise ValueError(f"multi_modal_data has unknown modality {modality!r}; valid modalities: "
                                 f"{list(MODALITIES)}")
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            limit = self.limits.get(modality)
            if limit is not None and len(items) > limit:
                raise ValueError(f"At most {limit} {modality}(s) may be provided in one prompt, got {len(items)} "
                                 "(--limit-mm-per-prompt)")
            if items:
                out[modality] = items
        if out and self.language_model_only:
            raise ValueError("this engine serves the text tower only (mm_language_model_only); media inputs are refused")
        if "video" in out:
            raise ValueError("video input is not supported yet; send the frames as images")
        return out

    def process(self, token_ids: list[int], mm_data: Mapping[str, Any],
                mm_processor_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[MultiModalItem]]:
        items = self.count_items(mm_data)
        images = [load_image(x, self.allowed_local_media_path) for x in items.get("image", [])]
        n_slots = sum(1 for t in token_ids if t == self.image_token_id)
        if n_slots != len(images):
            raise ValueError(f"the prompt has {n_slots} image placeholder(s) (token {self.image_token_id}, "
                             f"<|image_pad|>) but {len(images)} image(s) were given")
        if any(t == self.video_token_id for t in token_ids):
            raise ValueError("the prompt has a video placeholder (<|video_pad|>), but video input is not supported yet")
        if not images:
            return list(token_ids), []
        out = self.image_processor(mm_processor_kwargs)(images=images, return_tensors="np")
        pixels, grids = out["pixel_values"], [tuple(int(v) for v in g) for g in out["image_grid_thw"]]
        return self._expand(token_ids, pixels, grids)

    def _expand(self, token_ids: list[int], pixels: np.ndarray, grids: list[tuple[int, int, int]]):
        ids: list[int] = []
        result: list[MultiModalItem] = []
        start = 0
        it = iter(grids)
        for t in token_ids:
            if t != self.image_token_id:
                ids.append(t)
                continue
            g = next(it)
            if self.max_frame_patches is not None and g[1] * g[2] > self.max_frame_patches:
                raise ValueError(f"an image of {g[1] * g[2]} patches ({g[1]}x{g[2]}) does not fit "
                                 f"encoder_attention_block_size={self.max_frame_patches}; lower max_pixels "
                                 "(--mm-processor-kwargs) or raise the block size")
            llm = (g[0], g[1] // self.merge, g[2] // self.merge)
            n = llm[0] * llm[1] * llm[2]
            px = np.ascontiguousarray(pixels[start:start + g[0] * g[1] * g[2]], dtype=np.float32)
            start += px.shape[0]
            result.append(MultiModalItem("image", media_hash("image", px, g), px, g, [(len(ids), llm)]))
            ids.extend([self.image_token_id] * n)
        return ids, result
