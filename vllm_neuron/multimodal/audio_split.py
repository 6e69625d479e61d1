"""Long audio cut into windows the model takes whole (pure): each window at most `max_seconds`, ending at
the quietest moment of its last stretch (so a cut rarely splits a word), or at the limit when no stretch is
quiet. The transcription endpoint transcribes the windows and joins their texts in order."""
from __future__ import annotations

import numpy as np

FRAME_SECONDS = 0.02  # loudness is measured over 20 ms frames
SEARCH_SECONDS = 10.0  # the quietest frame is looked for in the window's last seconds


def split_on_silence(samples: np.ndarray, rate: int, max_seconds: float,
                     search_seconds: float = SEARCH_SECONDS) -> list[tuple[int, int]]:
    """[(start, end)] sample ranges covering `samples` in order, each at most max_seconds long."""
    n = len(samples)
    limit = int(max_seconds * rate)
    if limit < 1:
        raise ValueError(f"max_seconds={max_seconds} is shorter than one sample at {rate} Hz")
    frame = max(1, int(FRAME_SECONDS * rate))
    out, start = [], 0
    while n - start > limit:
        end = start + limit
        lo = max(start + limit // 2, end - int(search_seconds * rate))
        frames = (end - lo) // frame
        cut = end
        if frames > 0:
            seg = samples[end - frames * frame:end].astype(np.float64).reshape(frames, frame)
            energy = (seg ** 2).mean(axis=1)
            # The quietest frame, the latest one among equals: windows stay as long as they can.
            quietest = frames - 1 - int(np.argmin(energy[::-1]))
            cut = end - frames * frame + quietest * frame + frame // 2
        out.append((start, cut))
        start = cut
    if n > start or not out:
        out.append((start, n))
    return out
