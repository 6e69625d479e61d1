"""The /v1/audio/transcriptions and /v1/audio/translations form fields and responses (OpenAI's and vLLM's
names). Form fields arrive as text, so numbers and booleans are converted (lax), unknown fields refused."""
from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from vllm_neuron.entrypoints.openai.protocol import OpenAIBaseModel, UsageInfo, random_uuid

ResponseFormat = Literal["json", "text", "verbose_json", "srt", "vtt"]


class TranscriptionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    language: str | None = None  # ISO-639-1 code or the language's English name
    prompt: str | None = None  # context / hot words: the model's system turn
    response_format: ResponseFormat = "json"
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    timestamp_granularities: list[Literal["segment", "word"]] = Field(default_factory=list)
    stream: bool = False
    stream_include_usage: bool = False
    stream_continuous_usage_stats: bool = False
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    to_language: str | None = None  # vLLM's translation target
    ignore_eos: bool = False  # vLLM's sampling field: fixed-length outputs for benchmarks


class TranscriptionUsage(OpenAIBaseModel):
    type: Literal["duration"] = "duration"
    seconds: int


class TranscriptionResponse(OpenAIBaseModel):
    text: str
    usage: TranscriptionUsage | None = None


class TranscriptionSegment(OpenAIBaseModel):
    id: int
    seek: int  # where the segment starts, in 10 ms frames
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float | None
    compression_ratio: float
    no_speech_prob: float | None = None  # the model gives no such estimate


class TranscriptionResponseVerbose(OpenAIBaseModel):
    task: Literal["transcribe", "translate"] = "transcribe"
    language: str | None
    duration: float
    text: str
    segments: list[TranscriptionSegment]
    usage: TranscriptionUsage | None = None


class DeltaMessage(OpenAIBaseModel):
    content: str | None = None


class TranscriptionStreamChoice(OpenAIBaseModel):
    delta: DeltaMessage
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class TranscriptionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"trsc-{random_uuid()}")
    object: Literal["transcription.chunk"] = "transcription.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[TranscriptionStreamChoice]
    usage: UsageInfo | None = None
