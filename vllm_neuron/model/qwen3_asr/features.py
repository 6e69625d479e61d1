"""Host-side inputs of the Qwen3-ASR audio encoder (pure, CPU): a clip's log-mel frames from transformers'
own feature extractor, and clips cut into mel chunks laid out one attention window per encoder block,
padded to a block bucket.

Each window of a clip takes one block (`chunks_per_window` chunk slots); a clip's last window and the
bucket's spare blocks hold padding chunks of zero valid frames. `token_rows` maps the encoder's output rows
back to the clips' tokens, in clip order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_neuron.model.qwen3_asr.config import AudioArchConfig, post_conv_length


@dataclass
class AudioBlocks:
    mel: torch.Tensor  # [blocks * chunks_per_window, mel bins, chunk frames] float32
    chunk_len: torch.Tensor  # [blocks * chunks_per_window] valid frames per chunk
    token_rows: torch.Tensor  # [real tokens]: output row of each clip token, clips in order
    num_blocks: int  # blocks holding audio (the rest is padding)


def log_mel(feature_extractor, waveform: np.ndarray) -> np.ndarray:
    """[mel bins, frames] float32 of one mono clip at the extractor's rate (its valid frames only)."""
    out = feature_extractor(waveform.astype(np.float32), sampling_rate=feature_extractor.sampling_rate,
                            padding="longest", return_attention_mask=True, return_tensors="np")
    frames = int(out["attention_mask"][0].sum())
    return np.ascontiguousarray(out["input_features"][0][:, :frames], dtype=np.float32)


def audio_blocks(cfg: AudioArchConfig, clips: list[np.ndarray], num_blocks: int | None = None) -> AudioBlocks:
    """Encoder inputs of `clips` (each [mel bins, frames]) padded to `num_blocks` blocks (default: no padding)."""
    cpw, cf, w = cfg.chunks_per_window, cfg.chunk_frames, cfg.window_tokens
    used = sum(cfg.num_windows(c.shape[1]) for c in clips)
    total = used if num_blocks is None else num_blocks
    if used > total:
        raise ValueError(f"{len(clips)} clip(s) need {used} encoder blocks (one per {cfg.n_window_infer}-frame "
                         f"window); the bucket has {total}")
    mel = np.zeros((total * cpw, cfg.num_mel_bins, cf), dtype=np.float32)
    lens = np.zeros(total * cpw, dtype=np.int64)
    rows: list[np.ndarray] = []
    block = 0
    for clip in clips:
        frames = clip.shape[1]
        for j in range(-(-frames // cf)):
            slot = block * cpw + j  # chunk j of the clip: window j // cpw, its (j % cpw)-th chunk
            piece = clip[:, j * cf:(j + 1) * cf]
            mel[slot, :, :piece.shape[1]] = piece
            lens[slot] = piece.shape[1]
            n = post_conv_length(piece.shape[1])
            rows.append((slot // cpw) * w + (slot % cpw) * cfg.tokens_per_chunk + np.arange(n))
        block += cfg.num_windows(frames)
    token_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return AudioBlocks(torch.from_numpy(mel), torch.from_numpy(lens), torch.from_numpy(token_rows), used)
