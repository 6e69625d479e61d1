"""M-RoPE positions (pure): three position streams (temporal, height, width) for a prompt with vision
placeholders, and the delta that continues them into decode.

Text tokens get equal sequential positions on all three axes. The tokens of one image (or one video
frame) get start + their (t, h, w) coordinate on the merged grid, and the next token continues at
start + max(h, w), as transformers' `get_rope_index`. The KV cache and the attention mask keep using
the plain sequential positions; only the rotary embedding reads these. Past the prompt (decode) the
rotary position of sequential position p is p + delta on every axis.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class VisionRun:
    """One contiguous run of placeholder tokens in the prompt: an image, or one frame of a video."""

    offset: int  # index of the run's first token in the prompt
    grid: tuple[int, int, int]  # (t, h, w) in merged tokens: t * h * w tokens


def mrope_positions(num_tokens: int, runs: list[VisionRun]) -> tuple[np.ndarray, int]:
    """(positions [3, num_tokens] int64, delta) for a prompt whose vision runs are `runs` (any order)."""
    out = np.zeros((3, num_tokens), dtype=np.int64)
    cur = 0  # next rotary position
    i = 0  # next prompt index
    for run in sorted(runs, key=lambda r: r.offset):
        t, h, w = run.grid
        if run.offset < i or run.offset + t * h * w > num_tokens:
            raise ValueError(f"vision run at {run.offset} ({t * h * w} tokens) overlaps another or the prompt end")
        n_text = run.offset - i
        out[:, i:run.offset] = cur + np.arange(n_text)
        cur += n_text
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        end = run.offset + t * h * w
        out[0, run.offset:end] = cur + tt.reshape(-1)
        out[1, run.offset:end] = cur + hh.reshape(-1)
        out[2, run.offset:end] = cur + ww.reshape(-1)
        cur += max(h, w)
        i = end
    out[:, i:] = cur + np.arange(num_tokens - i)
    cur += num_tokens - i
    return out, cur - num_tokens


def rope_positions_for(positions: np.ndarray, prompt_positions: np.ndarray | None, delta: int) -> np.ndarray:
    """[3, N] rotary positions of sequential `positions` [N]: the prompt's M-RoPE positions inside the
    prompt, p + delta past it (generated tokens)."""
    out = np.repeat((positions + delta)[None, :], 3, axis=0)
    if prompt_positions is not None:
        inside = positions < prompt_positions.shape[1]
        out[:, inside] = prompt_positions[:, positions[inside]]
    return out
