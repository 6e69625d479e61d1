"""Audio from where requests put it: (array, sample rate) tuples, encoded bytes (wav, flac, mp3, ogg, m4a
and whatever else FFmpeg reads), data: / file: / http(s) URLs; decoded and resampled to the model's rate
in mono float32 by PyAV (FFmpeg's decoders and libswresample). Every problem is a ValueError naming it
(the server turns it into a 400); decoding stops at the duration limit instead of running on.
"""
from __future__ import annotations

import io

import numpy as np

from vllm_neuron import envs
from vllm_neuron.multimodal.media import MediaAccess, fetch_url

AUDIO_MEDIA_TYPES = ("audio/wav", "audio/x-wav", "audio/wave", "audio/flac", "audio/x-flac", "audio/mpeg",
                     "audio/mp3", "audio/ogg", "audio/opus", "audio/webm", "audio/mp4", "audio/m4a", "audio/x-m4a",
                     "audio/aac")
# input_audio parts name their format (OpenAI: wav, mp3); these are the ones we decode.
AUDIO_FORMATS = ("wav", "flac", "mp3", "ogg", "m4a", "mp4", "webm", "opus", "aac")


def max_seconds() -> float:
    return envs.VLLM_NEURON_MAX_AUDIO_SECONDS


def load_audio(source, rate: int, access: MediaAccess = MediaAccess(), what: str = "the audio") -> np.ndarray:
    """Mono float32 samples at `rate` from (array, sample_rate), bytes or a data:/file:/http(s): URL."""
    if isinstance(source, (tuple, list)) and len(source) == 2 and not isinstance(source[0], (str, bytes)):
        return resample_array(source[0], source[1], rate, what)
    if isinstance(source, np.ndarray):
        raise ValueError(f"{what} is a bare array: give (array, sample_rate) so it can be resampled to {rate} Hz")
    if isinstance(source, (bytes, bytearray, memoryview)):
        return decode_audio(bytes(source), rate, what)
    if isinstance(source, str):
        return decode_audio(fetch_url(source, AUDIO_MEDIA_TYPES, access), rate, _describe(source))
    raise ValueError(f"{what} must be (array, sample_rate), bytes or a URL string, got {type(source).__name__}")


def _describe(url: str) -> str:
    return "the data: URL audio" if url.startswith("data:") else f"the audio at {url[:200]!r}"


def _check_duration(samples: int, rate: int, what: str) -> None:
    if samples > max_seconds() * rate:
        raise ValueError(f"{what} is longer than the {max_seconds():g} s limit (VLLM_NEURON_MAX_AUDIO_SECONDS)")


def resample_array(array, sample_rate, rate: int, what: str = "the audio") -> np.ndarray:
    """A [samples] or [channels, samples] array at `sample_rate` -> mono float32 at `rate`."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float, np.integer, np.floating)) \
            or not 1000 <= sample_rate <= 384000:
        raise ValueError(f"{what}: sample rate {sample_rate!r} is not supported; give an integer rate in Hz "
                         "between 1000 and 384000")
    a = np.asarray(array)
    if a.dtype.kind not in "fiu" or a.ndim not in (1, 2) or a.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D (mono) or 2-D [channels, samples] numeric array, got "
                         f"shape {a.shape} and dtype {a.dtype}")
    if a.dtype.kind in "iu":
        a = a.astype(np.float32) / float(np.iinfo(a.dtype).max)
    a = a.astype(np.float32).reshape(-1, a.shape[-1]).mean(axis=0)
    if not np.isfinite(a).all():
        raise ValueError(f"{what} holds NaN or infinite samples")
    _check_duration(len(a), int(sample_rate), what)
    if int(sample_rate) == rate:
        return np.ascontiguousarray(a)
    import av

    frame = av.AudioFrame.from_ndarray(a[None, :], format="flt", layout="mono")
    frame.sample_rate = int(sample_rate)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
    out = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    out += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


def decode_audio(data: bytes, rate: int, what: str = "the audio file") -> np.ndarray:
    """Encoded audio -> mono float32 at `rate`; a ValueError for empty, non-audio, corrupt or too long input."""
    import av

    if not data:
        raise ValueError(f"{what} is empty")
    limit = int(max_seconds() * rate)
    pieces: list[np.ndarray] = []
    total = 0
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            streams = container.streams.audio
            if not streams:
                raise ValueError(f"{what} has no audio stream")
            stream = streams[0]
            # What the container says, checked before decoding anything; the decoded length is checked as it grows.
            declared = [float(stream.duration * stream.time_base)] if stream.duration and stream.time_base else []
            declared += [container.duration / 1e6] if container.duration else []
            if any(d > max_seconds() for d in declared):
                raise ValueError(f"{what} is longer than the {max_seconds():g} s limit (VLLM_NEURON_MAX_AUDIO_SECONDS)")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
            for frame in container.decode(stream):
                for f in resampler.resample(frame):
                    pieces.append(f.to_ndarray().reshape(-1))
                    total += pieces[-1].size
                if total > limit:
                    _check_duration(total, rate, what)
            for f in resampler.resample(None):
                pieces.append(f.to_ndarray().reshape(-1))
    except av.FFmpegError as e:
        raise ValueError(f"cannot decode {what} as audio: {e}") from None
    except (UnicodeDecodeError, EOFError) as e:
        raise ValueError(f"cannot decode {what} as audio: {e}") from None
    samples = np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)
    if samples.size == 0:
        raise ValueError(f"{what} decodes to no audio samples (truncated or corrupt)")
    _check_duration(samples.size, rate, what)
    if not np.isfinite(samples).all():
        raise ValueError(f"{what} decodes to NaN or infinite samples")
    return samples
