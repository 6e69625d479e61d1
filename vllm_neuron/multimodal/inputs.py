"""What a request carries per media item, in plain values (pickled to the engine core process)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass
class MultiModalItem:
    modality: str  # "image" or "video"
    mm_hash: str  # of the processed pixels and their grid: equal media give equal hashes
    pixel_values: np.ndarray  # [patches, patch_dim] float32, the processor's rows
    grid_thw: tuple[int, int, int]  # patch grid (t, h, w)
    # Where the item's embeddings go: runs of placeholder tokens (offset in the prompt, (t, h, w) in merged
    # tokens); an image is one run, a video one run per frame. Embedding rows fill the runs in order.
    runs: list[tuple[int, tuple[int, int, int]]]

    @property
    def num_tokens(self) -> int:
        return sum(t * h * w for _, (t, h, w) in self.runs)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    def token_positions(self) -> np.ndarray:
        """Prompt index of each embedding row, in row order."""
        return np.concatenate([np.arange(o, o + t * h * w) for o, (t, h, w) in self.runs])


def media_hash(modality: str, pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> str:
    h = hashlib.sha256(modality.encode())
    h.update(np.asarray(grid_thw, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(pixel_values, dtype=np.float32).tobytes())
    return h.hexdigest()


@dataclass
class AudioItem:
    """One audio clip of a prompt: its log-mel frames and the run of placeholder tokens its embeddings fill."""

    modality: str  # "audio"
    mm_hash: str  # of the mel frames: equal clips give equal hashes
    mel: np.ndarray  # [mel bins, frames] float32
    offset: int  # prompt index of the first placeholder token
    num_tokens: int

    def token_positions(self) -> np.ndarray:
        return np.arange(self.offset, self.offset + self.num_tokens)


def audio_hash(mel: np.ndarray) -> str:
    h = hashlib.sha256(b"audio")
    h.update(np.asarray(mel.shape, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(mel, dtype=np.float32).tobytes())
    return h.hexdigest()
