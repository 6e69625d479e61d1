"""`bench serve --dataset-name random-audio --backend openai-audio`: synthetic clips of chosen lengths (a
tone under noise, 16 kHz 16-bit WAV) sent to /v1/audio/transcriptions as multipart uploads with stream=true;
the result adds the audio seconds transcribed and the real-time factor (audio seconds per wall second: the
run's, and each request's median)."""
from __future__ import annotations

import argparse
import io
import time
import wave
from typing import Any

import httpx
import numpy as np

from vllm_neuron.benchmarks.prompts import SampleRequest

RATE = 16000


def add_random_audio_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("random-audio dataset options")
    g.add_argument("--random-audio-seconds", type=str, default="30",
                   help="Clip lengths in seconds, comma-separated; requests cycle through them (e.g. '5,30').")


def parse_seconds(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(not 0 < v <= 3600 for v in values):
        raise ValueError(f"--random-audio-seconds must be comma-separated lengths in (0, 3600] s, got {text!r}")
    return values


def wav_bytes(samples: np.ndarray, rate: int = RATE) -> bytes:
    """Mono float samples in [-1, 1] as a 16-bit PCM WAV file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def clip_wav(seconds: float, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    return wav_bytes(0.3 * np.sin(2 * np.pi * rng.uniform(150, 900) * t) + 0.05 * rng.standard_normal(t.shape))


def sample_random_audio_requests(num_requests: int, seconds: list[float], output_len: int,
                                 seed: int) -> list[SampleRequest]:
    return [SampleRequest(prompt="", prompt_len=0, expected_output_len=output_len, request_id=str(i),
                          audio=clip_wav(seconds[i % len(seconds)], seed + i),
                          audio_seconds=seconds[i % len(seconds)]) for i in range(num_requests)]


def multipart_fields(req: Any) -> dict[str, str]:
    fields = {"model": req.model, "stream": "true", "stream_include_usage": "true",
              "max_completion_tokens": str(req.output_len), "temperature": "0"}
    if req.ignore_eos:
        fields["ignore_eos"] = "true"
    fields.update({k: str(v) for k, v in req.extra_body.items()})
    return fields


async def send_audio_request(client: httpx.AsyncClient, req: Any, out: Any,
                             read_chunks: Any) -> Any:
    """One streamed transcription upload, timed like a text request (read_chunks parses the SSE stream)."""
    out.start_time = start = time.perf_counter()
    async with client.stream("POST", req.api_url, files={"file": ("clip.wav", req.audio, "audio/wav")},
                             data=multipart_fields(req), headers=req.headers) as resp:
        return await read_chunks(resp, out, start)


def rtf_section(audio_seconds: float, duration: float, per_request: list[float], width: int = 50) -> str:
    def row(label: str, value: float) -> str:
        return f"{label:<40} {value:<10.2f}"

    return "\n".join([f"{'Speech to text':-^{width}}", row("Audio seconds transcribed:", audio_seconds),
                      row("Real-time factor (audio s / wall s):", audio_seconds / duration if duration else 0.0),
                      row("Median per-request RTF:", float(np.median(per_request)) if per_request else 0.0)])
