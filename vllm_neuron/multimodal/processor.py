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
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from vllm_neuron.multimodal.inputs import MultiModalItem, media_hash
from vllm_neuron.multimodal.media import MediaAccess, load_image
from vllm_neuron.multimodal.video import (DEFAULT_SAMPLE_FPS, UNKNOWN_FPS, has_metadata, load_video, pad_to_patches,
                                          pair_frames, pair_timestamps, sample_indices)

MODALITIES = ("image", "video")


def _processor_keys() -> set[str]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorKwargs

    return set(Qwen2VLImageProcessorKwargs.__annotations__) | {"min_pixels", "max_pixels", "fps"}


def count_media(mm_data: Mapping[str, Any], modalities: tuple[str, ...], limits: Mapping[str, int],
                language_model_only: bool, is_one: Callable[[str, Any], bool]) -> dict[str, list]:
    """{modality: [items]} of `mm_data` after checking its modalities, the per-prompt limits
    (--limit-mm-per-prompt) and the text-only switch; is_one(modality, value): a single item, not a list."""
    out = {}
    for modality, value in mm_data.items():
        if modality not in modalities:
            raise ValueError(f"multi_modal_data has unknown modality {modality!r}; valid modalities for this model: "
                             f"{list(modalities)}")
        items = [value] if is_one(modality, value) else list(value)
        limit = limits.get(modality)
        if limit is not None and len(items) > limit:
            raise ValueError(f"At most {limit} {modality}(s) may be provided in one prompt, got {len(items)} "
                             "(--limit-mm-per-prompt)")
        if items:
            out[modality] = items
    if out and language_model_only:
        raise ValueError("this engine serves the text tower only (mm_language_model_only); media inputs are refused")
    return out


class MultiModalProcessor:
    def __init__(self, hf_config, model_path: str, *, mm_processor_kwargs: Mapping[str, Any] | None = None,
                 limits: Mapping[str, int] | None = None, allowed_local_media_path: str | None = None,
                 allowed_media_domains: list[str] | None = None,
                 language_model_only: bool = False, max_frame_patches: int | None = None, tokenizer=None,
                 embeddings_available: Callable[[str], bool] | None = None) -> None:
        """embeddings_available(mm_hash): an EPD prefill+decode instance without the vision tower, whose media
        must come encoded (its EC connector holds the item); None: the engine encodes what it lacks."""
        self.image_token_id = hf_config.image_token_id
        self.video_token_id = hf_config.video_token_id
        self.vision_start_token_id = hf_config.vision_start_token_id
        self.vision_end_token_id = hf_config.vision_end_token_id
        self.tokenizer = tokenizer  # for the timestamps written before each video frame pair
        self.merge = hf_config.vision_config.spatial_merge_size
        self.model_path = model_path
        self.limits = dict(limits or {})
        self.allowed_local_media_path = allowed_local_media_path
        self.media_access = MediaAccess(allowed_local_media_path,
                                        None if allowed_media_domains is None else tuple(allowed_media_domains))
        self.language_model_only = language_model_only
        self.max_frame_patches = max_frame_patches  # encoder_attention_block_size: a frame must fit a block
        self.embeddings_available = embeddings_available
        kwargs = self.check_kwargs(mm_processor_kwargs or {})
        self.default_fps = float(kwargs.pop("fps", DEFAULT_SAMPLE_FPS))
        self.default_kwargs = kwargs

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
        kwargs = {**self.default_kwargs, **{k: v for k, v in self.check_kwargs(overrides or {}).items() if k != "fps"}}
        return self._image_processor(json.dumps(kwargs, sort_keys=True))

    def count_items(self, mm_data: Mapping[str, Any]) -> dict[str, list]:
        """{modality: [items]} after validating modalities and the per-prompt limits."""
        return count_media(mm_data, MODALITIES, self.limits, self.language_model_only,
                           lambda modality, value: not isinstance(value, (list, tuple)) or
                           (modality == "video" and has_metadata(value)))

    def process(self, token_ids: list[int], mm_data: Mapping[str, Any],
                mm_processor_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[MultiModalItem]]:
        items = self.count_items(mm_data)
        kwargs = dict(mm_processor_kwargs or {})
        fps = float(kwargs.pop("fps", self.default_fps))
        for modality, token in (("image", self.image_token_id), ("video", self.video_token_id)):
            n_slots = sum(1 for t in token_ids if t == token)
            if n_slots != len(items.get(modality, [])):
                raise ValueError(f"the prompt has {n_slots} {modality} placeholder(s) (token {token}, "
                                 f"<|{modality}_pad|>) but {len(items.get(modality, []))} {modality}(s) were given")
        if not items:
            return list(token_ids), []
        processor = self.image_processor(kwargs)
        images = iter(self._images(processor, items.get("image", [])))
        videos = iter([self._video(processor, v, fps) for v in items.get("video", [])])
        ids: list[int] = []
        result: list[MultiModalItem] = []
        for t in token_ids:
            if t == self.image_token_id:
                px, g = next(images)
                llm = (1, g[1] // self.merge, g[2] // self.merge)
                result.append(MultiModalItem("image", media_hash("image", px, g), px, g, [(len(ids), llm)]))
                ids.extend([t] * (llm[1] * llm[2]))
            elif t == self.video_token_id:
                px, g, stamps = next(videos)
                runs = []
                for ts in stamps:  # transformers' Qwen3-VL layout: <t seconds><start><pad * n><end> per frame pair
                    ids.extend(self.tokenizer.encode(f"<{ts:.1f} seconds>", add_special_tokens=False))
                    ids.append(self.vision_start_token_id)
                    runs.append((len(ids), (1, g[1] // self.merge, g[2] // self.merge)))
                    ids.extend([t] * (g[1] * g[2] // self.merge ** 2))
                    ids.append(self.vision_end_token_id)
                result.append(MultiModalItem("video", media_hash("video", px, g), px, g, runs))
            else:
                ids.append(t)
        if self.embeddings_available is not None:
            self._check_encoded(result)
        return ids, result

    def _check_encoded(self, items: list[MultiModalItem]) -> None:
        """Refuses the request here, before the engine, when an item's embeddings were never written."""
        missing = [f"{i.modality} {n} ({i.mm_hash[:16]})" for n, i in enumerate(items)
                   if not self.embeddings_available(i.mm_hash)]
        if missing:
            raise ValueError(f"no encoder instance provided the embeddings of {', '.join(missing)}, and this engine "
                             "has no vision tower (mm_language_model_only): send multimodal requests through "
                             "`vllm-neuron epd-proxy`, whose encoder instances serve the same model with the same "
                             "--mm-processor-kwargs")

    def _check_frame(self, g: tuple[int, int, int], what: str) -> None:
        if self.max_frame_patches is not None and g[1] * g[2] > self.max_frame_patches:
            raise ValueError(f"{what} of {g[1] * g[2]} patches ({g[1]}x{g[2]}) does not fit "
                             f"encoder_attention_block_size={self.max_frame_patches}; lower max_pixels "
                             "(--mm-processor-kwargs) or raise the block size")

    def _images(self, processor, sources: list) -> list[tuple[np.ndarray, tuple[int, int, int]]]:
        if not sources:
            return []
        images = [load_image(x, self.media_access) for x in sources]
        out = processor(images=images, return_tensors="np")
        result, start = [], 0
        for g in out["image_grid_thw"]:
            g = tuple(int(v) for v in g)
            self._check_frame(g, "an image")
            n = g[0] * g[1] * g[2]
            result.append((np.ascontiguousarray(out["pixel_values"][start:start + n], dtype=np.float32), g))
            start += n
        return result

    def _video(self, processor, source, fps: float):
        """(pixel rows, patch grid (t, h, w), seconds of each temporal patch) of one video."""
        from PIL import Image

        video = load_video(source, self.media_access)
        frames, tp = video.frames, processor.temporal_patch_size
        if video.source_indices is None:
            idx = sample_indices(len(frames), video.fps, fps, tp)
            at = idx  # the frames are the whole source
        else:  # already sampled (vLLM's metadata): every frame, timed at its place in the source
            idx = pad_to_patches(list(range(len(frames))), tp)
            at = [video.source_indices[i] for i in idx]
        first = Image.fromarray(frames[idx[0]])
        # Every frame at the first frame's size: the processor then gives all of them one grid.
        picked = [Image.fromarray(frames[i]).resize(first.size) for i in idx]
        out = processor(images=picked, return_tensors="np")
        _, h, w = (int(v) for v in out["image_grid_thw"][0])
        grid = (len(idx) // tp, h, w)
        self._check_frame(grid, "a video frame")
        rows = pair_frames(out["pixel_values"], len(idx), 3, tp, processor.patch_size)
        return rows, grid, pair_timestamps(at, video.fps or UNKNOWN_FPS, tp)
