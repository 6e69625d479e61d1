"""Video for Qwen3-VL without torchvision (which has no build for the CPU torch): frames decoded by
PyAV, sampled at the requested fps, then each frame resized, normalized and patched by transformers'
own image processor; consecutive frames are paired into the temporal patches the vision tower expects.

The pairing is exact: the image processor fills both temporal slots of a patch with the same frame, so
taking slot 0 of frames 2k and 2k+1 gives the [C, 2, P, P] patch of that frame pair. Frames are sized
with the image processor's own min/max pixels per frame (transformers' video processor budgets pixels
over the whole clip instead, so a long clip may get smaller frames there); timestamps in the prompt
follow transformers' Qwen3-VL processor: the mean time of each frame pair, 24 fps when unknown.

A video may also come as vLLM's `(frames, metadata)` tuple (its video loader's and VideoAsset's form):
metadata "fps" is the source's frame rate and "frames_indices" where each given frame sits in the source,
which place the timestamps; the frames are taken as already sampled unless "do_sample_frames" is true.
"""
from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_neuron.multimodal.media import MediaAccess, fetch_url

VIDEO_MEDIA_TYPES = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/avi", "video/mpeg")
UNKNOWN_FPS = 24.0  # transformers' Qwen3-VL default for frames without metadata
DEFAULT_SAMPLE_FPS = 2.0


@dataclass(frozen=True)
class Video:
    frames: list[np.ndarray]  # RGB uint8 [H, W, 3]
    fps: float | None  # the source's frame rate (None: unknown)
    # Each frame's index in the source when the frames are already sampled (None: sample them at the
    # requested fps; the frames are then the whole source).
    source_indices: list[int] | None = None


def has_metadata(value: Any) -> bool:
    """vLLM's (frames, metadata) video tuple: one video, not two."""
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], Mapping)


def load_video(source, access: MediaAccess = MediaAccess()) -> Video:
    """A video from frames (an array [T, H, W, 3] or a list of arrays / PIL images), vLLM's (frames,
    metadata) tuple, encoded bytes, or a data:/file:/http(s): URL."""
    if has_metadata(source):
        return _with_metadata(_frames(source[0]), source[1])
    if isinstance(source, (np.ndarray, list, tuple)):
        return Video(_frames(source), None)
    if isinstance(source, str):
        source = fetch_url(source, VIDEO_MEDIA_TYPES, access)
    if isinstance(source, (bytes, bytearray)):
        return Video(*_decode(bytes(source)))
    raise ValueError(f"a video must be frames ([T, H, W, 3] array or list), (frames, metadata), bytes or a URL, "
                     f"got {type(source).__name__}")


def _frames(source) -> list[np.ndarray]:
    if isinstance(source, np.ndarray) and source.ndim == 4:
        return [np.asarray(f, dtype=np.uint8) for f in source]
    if isinstance(source, (list, tuple)) and len(source) > 0:
        return [np.asarray(f.convert("RGB") if hasattr(f, "convert") else f, dtype=np.uint8) for f in source]
    raise ValueError(f"video frames must be a [T, H, W, 3] array or a non-empty list of frames, got "
                     f"{type(source).__name__}")


def _with_metadata(frames: list[np.ndarray], meta: Mapping[str, Any]) -> Video:
    fps = meta.get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        raise ValueError(f"video metadata fps must be a positive number, got {fps!r}")
    sample = meta.get("do_sample_frames", False)
    if not isinstance(sample, bool):
        raise ValueError(f"video metadata do_sample_frames must be true or false, got {sample!r}")
    if sample:
        return Video(frames, fps)
    given = meta.get("frames_indices")
    indices = np.arange(len(frames)) if given is None else np.asarray(given)
    if indices.shape != (len(frames),) or not np.issubdtype(indices.dtype, np.integer) or indices.min() < 0:
        raise ValueError(f"video metadata frames_indices must give one non-negative index per frame ({len(frames)} "
                         f"frames), got {given!r}")
    return Video(frames, None if fps is None else float(fps), [int(i) for i in indices])


def _decode(data: bytes) -> tuple[list[np.ndarray], float | None]:
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            fps = float(stream.average_rate) if stream.average_rate else None
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    except (av.error.FFmpegError, IndexError, ValueError) as e:
        raise ValueError(f"cannot decode the video: {e}") from None
    if not frames:
        raise ValueError("the video has no frames")
    return frames, fps


def sample_indices(num_frames: int, source_fps: float | None, fps: float, temporal_patch: int) -> list[int]:
    """Frame indices sampled at `fps` (all frames when the source fps is unknown), padded with the last
    index to a multiple of the temporal patch size."""
    if source_fps is None or source_fps <= fps:
        idx = list(range(num_frames))
    else:
        idx = sorted(set(int(round(t)) for t in np.arange(0, num_frames, source_fps / fps)))
        idx = [i for i in idx if i < num_frames]
    return pad_to_patches(idx, temporal_patch)


def pad_to_patches(indices: list[int], temporal_patch: int) -> list[int]:
    """`indices` padded with the last one to a multiple of the temporal patch size."""
    idx = list(indices)
    while len(idx) % temporal_patch:
        idx.append(idx[-1])
    return idx


def pair_timestamps(indices: list[int], fps: float, temporal_patch: int) -> list[float]:
    """Seconds of each temporal patch: the mean time of its first and last frame."""
    t = [i / fps for i in indices]
    return [(t[k] + t[k + temporal_patch - 1]) / 2 for k in range(0, len(t), temporal_patch)]


def pair_frames(frame_rows: np.ndarray, num_frames: int, channels: int, temporal_patch: int,
                patch: int) -> np.ndarray:
    """Per-frame image-processor rows [T * N, C * tp * P * P] (each frame in every temporal slot) ->
    video rows [T / tp * N, C * tp * P * P], slot j of a patch taken from frame tp * k + j."""
    n = frame_rows.shape[0] // num_frames
    x = frame_rows.reshape(num_frames // temporal_patch, temporal_patch, n, channels, temporal_patch, patch, patch)
    x = np.stack([x[:, j, :, :, 0] for j in range(temporal_patch)], axis=3)  # [T/tp, N, C, tp, P, P]
    return np.ascontiguousarray(x.reshape(-1, channels * temporal_patch * patch * patch), dtype=np.float32)
