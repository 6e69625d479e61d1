"""A transcription's segments as OpenAI's text response formats (pure): SubRip (srt) and WebVTT (vtt),
and the zlib compression ratio verbose_json reports per segment."""
from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any


def _clock(seconds: float, decimal: str) -> str:
    ms = int(round(max(seconds, 0.0) * 1000))
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{decimal}{ms:03d}"


def to_srt(segments: Sequence[Any]) -> str:
    """Numbered cues `start --> end` (HH:MM:SS,mmm), one per segment with text."""
    cues = [s for s in segments if s.text.strip()]
    return "".join(f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n\n"
                   for i, s in enumerate(cues, 1))


def to_vtt(segments: Sequence[Any]) -> str:
    """A WEBVTT header, then one `start --> end` (HH:MM:SS.mmm) cue per segment with text."""
    return "WEBVTT\n\n" + "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n\n"
                                  for s in segments if s.text.strip())


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0
