"""One streamed request to an OpenAI-compatible server, timed chunk by chunk.

Works with any server that speaks the OpenAI streaming protocol (ours, vLLM, llama.cpp's
llama-server): server-sent events `data: {...}` ending with `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

BACKENDS = ("openai", "openai-chat", "openai-embeddings", "openai-audio")
# Kept short in results: a server may answer an error with a whole HTML page.
_MAX_ERROR_CHARS = 2000


@dataclass
class RequestInput:
    """What to send: one prompt to one endpoint."""

    api_url: str
    model: str
    prompt: str
    prompt_len: int
    output_len: int
    chat: bool = False
    ignore_eos: bool = False
    # Sampling options and anything from --extra-body; merged last into the JSON body.
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    multi_modal_content: list[dict] | None = None  # chat content parts before the prompt text
    embeddings: bool = False  # /v1/embeddings: one non-streamed request, its latency is its TTFT and E2EL
    audio: bytes | None = None  # /v1/audio/transcriptions: the uploaded clip (random_audio.py)
    audio_seconds: float = 0.0


@dataclass
class RequestOutput:
    """What came back and when. Times are seconds (perf_counter clock)."""

    success: bool = False
    generated_text: str = ""
    # From the server's usage chunk; None when the server sent none.
    output_tokens: int | None = None
    prompt_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    # perf_counter of each content chunk, for the peak-throughput buckets.
    chunk_times: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""


def build_payload(req: RequestInput) -> dict[str, Any]:
    """The JSON body: streaming with a usage chunk, max_tokens = the wanted output length."""
    body: dict[str, Any] = {"model": req.model, "stream": True,
                            "stream_options": {"include_usage": True}}
    if req.chat:
        content = req.prompt if not req.multi_modal_content else \
            req.multi_modal_content + [{"type": "text", "text": req.prompt}]
        body["messages"] = [{"role": "user", "content": content}]
        # Newer servers read max_completion_tokens, older ones (llama-server) max_tokens.
        body["max_completion_tokens"] = req.output_len
        body["max_tokens"] = req.output_len
    else:
        body["prompt"] = req.prompt
        body["max_tokens"] = req.output_len
    if req.ignore_eos:
        # Only when wanted: strict servers reject fields they do not know.
        body["ignore_eos"] = True
    body.update(req.extra_body)
    return body


def _chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # Reasoning models stream their thinking first; those are output tokens too.
    return (delta.get("content") or delta.get("reasoning_content")
            or delta.get("reasoning") or "")


def _error_text(payload: Any) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message") or payload["error"])
    if isinstance(payload, dict) and "error" in payload:
        return str(payload["error"])
    return str(payload)


async def send_request(client: httpx.AsyncClient, req: RequestInput) -> RequestOutput:
    """Send one streaming request and time it; never raises, failures are in the output.

    TTFT is the time to the first chunk that carries text, ITL the gaps between such chunks
    (role-only and usage chunks carry no token), latency the time until the stream ended.
    """
    if req.embeddings:
        return await send_embeddings_request(client, req)
    out = RequestOutput(prompt_len=req.prompt_len)
    try:
        if req.audio is not None:  # a transcription upload (random_audio.py)
            from vllm_neuron.benchmarks.random_audio import send_audio_request

            return await send_audio_request(client, req, out, lambda r, o, t: read_stream(r, o, t, chat=True))
        out.start_time = start = time.perf_counter()
        async with client.stream("POST", req.api_url, json=build_payload(req),
                                 headers={"Content-Type": "application/json", **req.headers}) as resp:
            return await read_stream(resp, out, start, req.chat)
    except Exception as e:  # noqa: BLE001 - any failure of one request is data, not a crash
        out.error = f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]
    return out


async def read_stream(resp: httpx.Response, out: RequestOutput, start: float, chat: bool) -> RequestOutput:
    """The SSE answer of a streamed request, timed into `out` (the request was sent at `start`)."""
    last = start
    if resp.status_code != 200:
        body = (await resp.aread()).decode("utf-8", errors="replace")
        try:
            detail = _error_text(json.loads(body))
        except ValueError:
            detail = body
        out.error = f"HTTP {resp.status_code}: {detail}"[:_MAX_ERROR_CHARS]
        return out
    async for line in resp.aiter_lines():
        line = line.strip()
        # SSE comments (":"), event names and blank separators carry no data.
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        now = time.perf_counter()
        chunk = json.loads(data)
        if "error" in chunk:
            out.error = ("error in stream: " + _error_text(chunk))[:_MAX_ERROR_CHARS]
            return out
        text = _chunk_text(chunk, chat)
        if text:
            if not out.chunk_times:
                out.ttft = now - start
            else:
                out.itl.append(now - last)
            last = now
            out.chunk_times.append(now)
            out.generated_text += text
        usage = chunk.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            out.output_tokens = int(usage["completion_tokens"])
    out.latency = time.perf_counter() - start
    if not out.chunk_times:
        out.error = "the stream carried no generated text, so no TTFT could be measured"
        return out
    out.success = True
    return out


async def send_embeddings_request(client: httpx.AsyncClient, req: RequestInput) -> RequestOutput:
    """One /v1/embeddings request (vLLM's openai-embeddings backend): no stream and no output tokens; the
    server's usage.prompt_tokens counts the input when it sends one."""
    out = RequestOutput(prompt_len=req.prompt_len)
    out.start_time = start = time.perf_counter()
    try:
        resp = await client.post(req.api_url, json={"model": req.model, "input": req.prompt, **req.extra_body},
                                 headers={"Content-Type": "application/json", **req.headers})
        out.latency = out.ttft = time.perf_counter() - start
        try:
            payload = resp.json()
        except ValueError:
            payload = resp.text
        if resp.status_code != 200:
            out.error = f"HTTP {resp.status_code}: {_error_text(payload)}"[:_MAX_ERROR_CHARS]
        elif not isinstance(payload, dict) or not payload.get("data"):
            out.error = f"no embeddings in the answer: {str(payload)[:200]}"
        else:
            usage = payload.get("usage") or {}
            out.prompt_len = int(usage.get("prompt_tokens") or req.prompt_len)
            out.output_tokens = 0
            out.success = True
    except Exception as e:  # noqa: BLE001 - any failure of one request is data, not a crash
        out.error = f"{type(e).__name__}: {e}"[:_MAX_ERROR_CHARS]
    return out


async def fetch_first_model(client: httpx.AsyncClient, base_url: str,
                            headers: dict[str, str]) -> str:
    """The first model id from GET {base_url}/v1/models, as vLLM's bench does by default."""
    url = f"{base_url}/v1/models"
    try:
        resp = await client.get(url, headers=headers)
        resp.raise_for_status()
        data = resp.json()
    except (httpx.HTTPError, ValueError) as e:
        raise RuntimeError(f"Could not list models at {url} (is the server running and is "
                           f"--base-url / --host / --port right?): {e}") from e
    models = data.get("data") if isinstance(data, dict) else None
    if not models:
        raise RuntimeError(f"{url} lists no models; pass --model")
    return str(models[0]["id"])
