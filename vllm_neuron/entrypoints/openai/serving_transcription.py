"""/v1/audio/transcriptions and /v1/audio/translations: a multipart upload decoded (PyAV, within the size
and duration limits), cut into windows of at most 30 s on silence (multimodal/audio_split.py), one engine
request per window in the checkpoint's own prompt format, the texts joined in order; json / text /
verbose_json / srt / vtt, or a stream of vLLM's `transcription.chunk` objects.

Every bad upload (empty, not audio, truncated or corrupt, too long, too large, an unsupported format) and a
model that does not transcribe are a 400 (a 413 for the size) with the OpenAI error object, decided before
the engine sees anything.
"""
from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from vllm_neuron import envs
from vllm_neuron.entrypoints.openai.errors import BadRequestError, RequestTooLargeError, from_exception
from vllm_neuron.entrypoints.openai.multipart_form import FormData, check_multipart, parse_form
from vllm_neuron.entrypoints.openai.protocol import UsageInfo
from vllm_neuron.entrypoints.openai.protocol_audio import (DeltaMessage, TranscriptionRequest, TranscriptionResponse,
                                                           TranscriptionResponseVerbose, TranscriptionSegment,
                                                           TranscriptionStreamChoice, TranscriptionStreamResponse,
                                                           TranscriptionUsage)
from vllm_neuron.entrypoints.openai.request_body import read_body
from vllm_neuron.entrypoints.openai.request_policy import parse_request
from vllm_neuron.entrypoints.openai.serving_engine import OpenAIServing, RequestTracker
from vllm_neuron.entrypoints.openai.streaming import SSE_DONE, run_until_disconnect, sse
from vllm_neuron.entrypoints.openai.transcript_formats import compression_ratio, to_srt, to_vtt
from vllm_neuron.multimodal.audio import decode_audio
from vllm_neuron.multimodal.audio_split import split_on_silence
from vllm_neuron.sampling_params import RequestOutputKind, SamplingParams

WINDOW_SECONDS = 30.0
# File name extensions OpenAI lists for uploads (and the other containers FFmpeg reads them in).
UPLOAD_EXTENSIONS = ("flac", "m4a", "mp3", "mp4", "mpeg", "mpga", "oga", "ogg", "opus", "wav", "webm", "aac")
_FORM_OVERHEAD = 64 * 1024  # the form's other fields and boundaries beside the file
_NO_SPACE_LANGUAGES = ("Chinese", "Cantonese", "Japanese", "Thai")


def language_names() -> dict[str, str]:
    """ISO code -> the English name Qwen3-ASR's prompt uses (transformers' table for the model)."""
    from transformers.models.qwen3_asr.processing_qwen3_asr import LANGUAGE_CODE_TO_NAME

    return dict(LANGUAGE_CODE_TO_NAME)


@dataclass
class _Window:
    start: float
    end: float
    prompt_ids: list[int]
    items: list
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class OpenAIServingTranscription(OpenAIServing):
    @property
    def max_upload_bytes(self) -> int:
        return envs.VLLM_MAX_AUDIO_CLIP_FILESIZE_MB * 2**20

    async def create(self, raw_request: Request, task: str) -> Response:
        """task: "transcribe" or "translate"."""
        arrival = time.monotonic()
        content_type = raw_request.headers.get("content-type", "")
        check_multipart(content_type)
        try:
            body = await read_body(raw_request, self.max_upload_bytes + _FORM_OVERHEAD,
                                   self.limits.body_read_timeout_s)
        except RequestTooLargeError:
            raise self._too_large() from None
        form = await self.run_blocking(parse_form, content_type, body)
        req = parse_request(TranscriptionRequest, self._fields(form))
        model = self.models.resolve(req.model)
        proc = self.engine.audio_processor
        if proc is None:
            raise BadRequestError(f"The model `{model}` does not support transcription: it takes no audio (serve a "
                                  "speech-to-text model such as Qwen3-ASR).", param="model")
        if task == "translate":
            raise BadRequestError(f"The model `{model}` does not support translation (Qwen3-ASR transcribes in the "
                                  "spoken language); use /v1/audio/transcriptions.", param="model")
        if req.to_language is not None:
            raise BadRequestError("to_language applies to /v1/audio/translations only.", param="to_language")
        language = self._language(req.language)
        self._check_formats(req)
        self.check_engine()
        filename, data = self._upload(form)
        self._check_size(data)
        try:
            samples = await self.run_blocking(decode_audio, data, proc.sampling_rate, f"the uploaded file {filename!r}")
        except ValueError as e:
            raise BadRequestError(str(e), param="file") from None
        windows = await self._windows(req, language, samples, proc)
        duration = len(samples) / proc.sampling_rate
        return await self.admitted(len(windows), lambda ticket: self._serve(
            req, model, language, windows, duration, RequestTracker(self, arrival, ticket), raw_request))

    # ---- the request ----------------------------------------------------------------------------

    @staticmethod
    def _fields(form: FormData) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, values in form.fields.items():
            if name in ("timestamp_granularities[]", "timestamp_granularities"):
                out["timestamp_granularities"] = out.get("timestamp_granularities", []) + values
            else:
                out[name] = values[-1]
        for name in form.files:
            if name != "file":
                raise BadRequestError(f"unexpected file field {name!r}; the audio goes in `file`.", param=name)
        return out

    @staticmethod
    def _language(value: str | None) -> str | None:
        if value is None or value == "":
            return None
        names = language_names()
        if value in names:
            return names[value]
        by_name = {n.lower(): n for n in names.values()}
        if value.lower() in by_name:
            return by_name[value.lower()]
        raise BadRequestError(f"language {value!r} is not supported by this model; supported: {sorted(names)} (or "
                              "their English names)", param="language")

    @staticmethod
    def _check_formats(req: TranscriptionRequest) -> None:
        if "word" in req.timestamp_granularities:
            raise BadRequestError("timestamp_granularities 'word' is not supported: the model gives no word "
                                  "timestamps; 'segment' is (with response_format verbose_json).",
                                  param="timestamp_granularities")
        if req.timestamp_granularities and req.response_format != "verbose_json":
            raise BadRequestError("timestamp_granularities needs response_format verbose_json.",
                                  param="timestamp_granularities")
        if req.stream and req.response_format not in ("json", "text"):
            raise BadRequestError(f"stream=true is not supported with response_format {req.response_format!r}; "
                                  "use json or text.", param="stream")
        if (req.stream_include_usage or req.stream_continuous_usage_stats) and not req.stream:
            raise BadRequestError("stream_include_usage needs stream=true.", param="stream_include_usage")

    @staticmethod
    def _upload(form: FormData) -> tuple[str, bytes]:
        if "file" not in form.files:
            raise BadRequestError("the form has no `file` (the audio to transcribe).", param="file")
        filename, data = form.files["file"]
        ext = os.path.splitext(filename)[1].lower().lstrip(".")
        if ext and ext not in UPLOAD_EXTENSIONS:
            raise BadRequestError(f"Invalid file format {ext!r}. Supported formats: {list(UPLOAD_EXTENSIONS)}",
                                  param="file")
        if not data:
            raise BadRequestError(f"the uploaded file {filename!r} is empty.", param="file")
        return filename, data

    def _check_size(self, data: bytes) -> None:
        if len(data) > self.max_upload_bytes:
            raise self._too_large()

    @staticmethod
    def _too_large() -> RequestTooLargeError:
        return RequestTooLargeError(f"The uploaded audio exceeds the {envs.VLLM_MAX_AUDIO_CLIP_FILESIZE_MB} MB limit "
                                    "(VLLM_MAX_AUDIO_CLIP_FILESIZE_MB).", param="file")

    async def _windows(self, req: TranscriptionRequest, language: str | None, samples: np.ndarray,
                       proc: Any) -> list[_Window]:
        """One window per <= 30 s stretch (cut on silence), its prompt tokens and processed audio."""
        rate = proc.sampling_rate
        longest = min(WINDOW_SECONDS, proc.max_clip_seconds or WINDOW_SECONDS)
        messages: list[dict] = [{"role": "system", "content": req.prompt}] if req.prompt else []
        # The template sees one audio part; its source (collected into `media`, unused) is each window's samples.
        messages.append({"role": "user", "content": [{"type": "audio", "audio": "window"}]})
        text = await self.render_chat(messages, request_template=None, add_generation_prompt=True,
                                      continue_final_message=False, media={})
        if language is not None:  # the checkpoint's way of fixing the language: the answer's prefix
            text += f"language {language}<asr_text>"
        ids = await self.encode(text, add_special_tokens=False, param="prompt")
        out = []
        for a, b in split_on_silence(samples, rate, longest):
            try:
                w_ids, items = await self.run_blocking(self.engine.process_multimodal, ids,
                                                       {"audio": [(samples[a:b], rate)]})
            except ValueError as e:
                raise BadRequestError(str(e), param="file") from None
            out.append(_Window(a / rate, b / rate, w_ids, items))
        return out

    def _params(self, req: TranscriptionRequest, window: _Window, verbose: bool) -> SamplingParams:
        max_tokens = self.resolve_max_tokens(len(window.prompt_ids), req.max_completion_tokens,
                                             "max_completion_tokens")
        try:
            sp = SamplingParams(temperature=req.temperature, top_p=req.top_p if req.top_p is not None else 1.0,
                                top_k=req.top_k if req.top_k is not None else 0, seed=req.seed, max_tokens=max_tokens,
                                ignore_eos=req.ignore_eos,
                                logprobs=0 if verbose else None, output_kind=RequestOutputKind.DELTA)
            sp.verify(self.vocab_size, None if self.max_logprobs == -1 else self.max_logprobs)
        except ValueError as e:
            raise BadRequestError(str(e)) from None
        return sp

    # ---- generation -----------------------------------------------------------------------------

    async def _run_window(self, tracker: RequestTracker, req: TranscriptionRequest, window: _Window, rid: str,
                          verbose: bool, queue: asyncio.Queue | None = None) -> None:
        from vllm_neuron.engine.protocol import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=window.prompt_ids, multi_modal_items=window.items)
        async for res in self.generate(tracker, prompt, self._params(req, window, verbose), rid,
                                       len(window.prompt_ids)):
            for o in res.outputs:
                window.token_ids += o.token_ids
                if o.logprobs:
                    window.logprobs += [step[t].logprob for t, step in zip(o.token_ids, o.logprobs) if t in step]
                if o.finish_reason is not None:
                    window.finish_reason, window.stop_reason = o.finish_reason, o.stop_reason
            if queue is not None:
                queue.put_nowait(False)
        if queue is not None:
            queue.put_nowait(True)

    def _split(self, token_ids: list[int], language: str | None, final: bool = True) -> tuple[str | None, str]:
        """(language, transcript) of a window's output: the model writes `language X<asr_text>` first unless the
        prompt fixed the language; an output that never writes the marker is all transcript (transformers'
        parsing), known once it is `final`."""
        tok = self.tokenizer
        marker = self._marker_id()
        if language is None and marker is not None and marker in token_ids:
            i = token_ids.index(marker)
            head = tok.decode(token_ids[:i], skip_special_tokens=True).strip()
            found = head[len("language "):].strip() if head.lower().startswith("language ") else head
            return (None if found.lower() in ("", "none") else found), tok.decode(token_ids[i + 1:],
                                                                                skip_special_tokens=True)
        if language is None and marker is not None and not final:
            return None, ""  # maybe still inside the language prefix
        return language, tok.decode(token_ids, skip_special_tokens=True)

    def _marker_id(self) -> int | None:
        """The `<asr_text>` token that ends the language prefix (None when the vocabulary has no such token)."""
        marker = self.tokenizer.convert_tokens_to_ids("<asr_text>")
        return marker if isinstance(marker, int) and self.tokenizer.convert_ids_to_tokens(marker) == "<asr_text>" \
            else None

    @staticmethod
    def _join(texts: list[str], language: str | None) -> str:
        sep = "" if language in _NO_SPACE_LANGUAGES else " "
        return sep.join(t.strip() for t in texts if t.strip())

    async def _serve(self, req: TranscriptionRequest, model: str, language: str | None, windows: list[_Window],
                     duration: float, tracker: RequestTracker, raw_request: Request) -> Response:
        base = self.base_request_id(raw_request, None)
        rids = [f"trsc-{base}-{i}" for i in range(len(windows))]
        verbose = req.response_format == "verbose_json"
        if req.stream:
            return StreamingResponse(self._stream(req, model, language, windows, duration, tracker, rids),
                                     media_type="text/event-stream")

        async def full() -> bool:
            error: BaseException | None = None
            try:
                await asyncio.gather(*(self._run_window(tracker, req, w, rid, verbose)
                                       for w, rid in zip(windows, rids)))
                return True
            except BaseException as e:
                error = e
                raise
            finally:
                tracker.close(error)

        if await run_until_disconnect(full(), raw_request) is None:
            return Response(status_code=499)
        return self._response(req, language, windows, duration)

    def _response(self, req: TranscriptionRequest, language: str | None, windows: list[_Window],
                  duration: float) -> Response:
        parts = [self._split(w.token_ids, language) for w in windows]
        found = next((lang for lang, _ in parts if lang), language)
        text = self._join([t for _, t in parts], found)
        usage = TranscriptionUsage(seconds=math.ceil(duration))
        if req.response_format == "text":
            return PlainTextResponse(text)
        if req.response_format == "json":
            return JSONResponse(TranscriptionResponse(text=text, usage=usage).model_dump())
        segments = [TranscriptionSegment(id=i, seek=int(round(w.start * 100)), start=w.start, end=w.end,
                                         text=t.strip(), tokens=w.token_ids, temperature=req.temperature,
                                         avg_logprob=float(np.mean(w.logprobs)) if w.logprobs else None,
                                         compression_ratio=compression_ratio(t.strip()))
                    for i, (w, (_, t)) in enumerate(zip(windows, parts))]
        if req.response_format == "srt":
            return PlainTextResponse(to_srt(segments))
        if req.response_format == "vtt":
            return PlainTextResponse(to_vtt(segments), media_type="text/vtt")
        verbose = TranscriptionResponseVerbose(language=found, duration=duration, text=text, segments=segments,
                                               usage=usage)
        return JSONResponse(verbose.model_dump())

    async def _stream(self, req: TranscriptionRequest, model: str, language: str | None, windows: list[_Window],
                      duration: float, tracker: RequestTracker, rids: list[str]) -> AsyncIterator[str]:
        """Every window generates at once (batched by the engine); their text is sent in order as it comes."""
        queues = [asyncio.Queue() for _ in windows]
        tasks = [asyncio.create_task(self._run_window(tracker, req, w, rid, False, q))
                 for w, rid, q in zip(windows, rids, queues)]
        chunk_id = f"trsc-{rids[0]}"
        error: BaseException | None = None
        sent_any = False
        try:
            for w, q, task in zip(windows, queues, tasks):
                sent = ""
                done = False
                while not done:
                    getter = asyncio.ensure_future(q.get())
                    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        task.result()  # the window failed: raise its error here
                        done = True
                    else:
                        done = getter.result()
                    _, text = self._split(w.token_ids, language, final=done)
                    if sent_any and not sent and text.strip():
                        text = (" " if language not in _NO_SPACE_LANGUAGES else "") + text.lstrip()
                    elif not sent:
                        text = text.lstrip()
                    if len(text) > len(sent) and not text.endswith("\ufffd"):
                        delta, sent = text[len(sent):], text
                        sent_any = True
                        yield sse(TranscriptionStreamResponse(id=chunk_id, model=model, choices=[
                            TranscriptionStreamChoice(delta=DeltaMessage(content=delta))]), exclude_none=True)
            last = windows[-1]
            yield sse(TranscriptionStreamResponse(id=chunk_id, model=model, choices=[TranscriptionStreamChoice(
                delta=DeltaMessage(), finish_reason=last.finish_reason or "stop", stop_reason=last.stop_reason)]),
                exclude_none=True)
            if req.stream_include_usage:
                prompt = sum(len(w.prompt_ids) for w in windows)
                completion = sum(len(w.token_ids) for w in windows)
                yield sse(TranscriptionStreamResponse(id=chunk_id, model=model, choices=[], usage=UsageInfo(
                    prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)))
        except Exception as e:
            error = e
            yield f"data: {from_exception(e).model_dump_json()}\n\n"
        except BaseException as e:
            error = e
            raise
        finally:
            for task in tasks:
                task.cancel()
            tracker.close(error)
        yield SSE_DONE
