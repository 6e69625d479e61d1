"""Prompt + audio -> prompt tokens with expanded placeholders and the clips the engine encodes (Qwen3-ASR).

The prompt holds one `<|audio_pad|>` token per clip (the checkpoint's chat template writes
`<|audio_start|><|audio_pad|><|audio_end|>`); each is expanded to the clip's encoder token count. Log-mel
frames come from transformers' own feature extractor for the model (`Qwen3ASRFeatureExtractor`, configured
by the checkpoint's preprocessor_config.json); audio is decoded and resampled by multimodal/audio.py.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from vllm_neuron.model.qwen3_asr.config import AudioArchConfig
from vllm_neuron.model.qwen3_asr.features import log_mel
from vllm_neuron.multimodal.audio import load_audio
from vllm_neuron.multimodal.inputs import AudioItem, audio_hash
from vllm_neuron.multimodal.media import MediaAccess
from vllm_neuron.multimodal.processor import count_media

MODALITIES = ("audio",)


class AudioProcessor:
    modalities = MODALITIES
    def __init__(self, hf_config, model_path: str, *, limits: Mapping[str, int] | None = None,
                 allowed_local_media_path: str | None = None, allowed_media_domains: list[str] | None = None,
                 language_model_only: bool = False, max_blocks: int | None = None,
                 mm_processor_kwargs: Mapping[str, Any] | None = None) -> None:
        if mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs {sorted(mm_processor_kwargs)} are not supported for audio models; "
                             "valid keys: []")
        self.audio_token_id = hf_config.audio_token_id
        self.cfg = AudioArchConfig.from_hf(hf_config.audio_config)
        self.model_path = model_path
        self.limits = dict(limits or {})
        self.media_access = MediaAccess(allowed_local_media_path,
                                        None if allowed_media_domains is None else tuple(allowed_media_domains))
        self.language_model_only = language_model_only
        self.max_blocks = max_blocks  # the largest encoder bucket: one clip's windows must fit it
        self.sampling_rate = int(self.feature_extractor().sampling_rate)

    @functools.lru_cache(maxsize=1)
    def feature_extractor(self):
        from transformers import Qwen3ASRFeatureExtractor

        try:
            return Qwen3ASRFeatureExtractor.from_pretrained(self.model_path)
        except OSError as e:
            raise ValueError(f"the audio model at {self.model_path!r} has no usable preprocessor_config.json "
                             f"(Qwen3ASRFeatureExtractor): {e}") from None

    @property
    def max_clip_seconds(self) -> float | None:
        """The longest clip one prompt may carry (its windows fill the largest encoder bucket)."""
        if self.max_blocks is None:
            return None
        return self.max_blocks * self.cfg.n_window_infer / 100.0

    def count_items(self, mm_data: Mapping[str, Any]) -> dict[str, list]:
        """{"audio": [clips]} after validating the modality and the per-prompt limit; a clip is (array, rate),
        bytes or a URL, several a list of them."""
        return count_media(mm_data, MODALITIES, self.limits, self.language_model_only,
                           lambda modality, value: not isinstance(value, list))

    def clip_mel(self, source, what: str = "the audio") -> np.ndarray:
        """[mel bins, frames] of one clip (decoded / resampled first), checked against the encoder bucket."""
        wave = load_audio(source, self.sampling_rate, self.media_access, what)
        mel = log_mel(self.feature_extractor(), wave)
        n = self.cfg.num_windows(mel.shape[1])
        if self.max_blocks is not None and n > self.max_blocks:
            raise ValueError(f"{what} lasts {len(wave) / self.sampling_rate:.1f} s: it needs {n} encoder blocks, more "
                             f"than the largest num_encoder_input_buckets entry ({self.max_blocks}, "
                             f"{self.max_clip_seconds:g} s); split it or raise the bucket")
        return mel

    def process(self, token_ids: list[int], mm_data: Mapping[str, Any],
                mm_processor_kwargs: Mapping[str, Any] | None = None) -> tuple[list[int], list[AudioItem]]:
        if mm_processor_kwargs:
            raise ValueError(f"mm_processor_kwargs {sorted(mm_processor_kwargs)} are not supported for audio models")
        items = self.count_items(mm_data)
        clips = items.get("audio", [])
        n_slots = sum(1 for t in token_ids if t == self.audio_token_id)
        if n_slots != len(clips):
            raise ValueError(f"the prompt has {n_slots} audio placeholder(s) (token {self.audio_token_id}, "
                             f"<|audio_pad|>) but {len(clips)} audio clip(s) were given")
        if not clips:
            return list(token_ids), []
        mels = iter([self.clip_mel(c, f"audio {i}") for i, c in enumerate(clips)])
        ids: list[int] = []
        result: list[AudioItem] = []
        for t in token_ids:
            if t == self.audio_token_id:
                mel = next(mels)
                n = self.cfg.num_tokens(mel.shape[1])
                result.append(AudioItem("audio", audio_hash(mel), mel, len(ids), n))
                ids.extend([t] * n)
            else:
                ids.append(t)
        return ids, result
