"""`vllm-neuron epd-proxy --encode URL... --pd URL... --port N`: one OpenAI-compatible endpoint in front of EPD
encoder instances (--mm-encoder-only) and prefill+decode instances (an EC consumer).

A chat request with image or video parts becomes one encode job per media item (vLLM's EPD proxy does the
same): a chat request holding only that part, `max_tokens: 1`, sent to an encoder instance, least outstanding
jobs first and round robin among idle ones, all of a request's jobs at once. Once they answered, the original
request goes to a prefill+decode instance, which reads the embeddings from its EC connector; its answer,
streamed or not, passes through (disagg/proxy.py's relay). Text-only requests and /v1/completions go straight to
a prefill+decode instance.

Failures: an encoder instance that is unreachable, dies mid-job, answers 5xx or takes longer than
`--encode-timeout` is skipped for the next one (and for a few seconds after), at most `--encode-attempts`
instances per item; when none could encode an item the request still goes on, and the prefill+decode
instance computes the item itself if it has the vision tower, or fails the request with an error naming the
item (never a hang). A 4xx from an encoder is the request's fault (bad media) and is returned as is.
"""
from __future__ import annotations

import asyncio
import json
import uuid

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter

from vllm_neuron.entrypoints.disagg.pool import InstancePool
from vllm_neuron.entrypoints.disagg.proxy import DisaggProxy, _Metrics, build_app
from vllm_neuron.entrypoints.openai.chat_template import MEDIA_PARTS
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

_VISION = {kind for kind, modality in MEDIA_PARTS.items() if modality in ("image", "video")}


def media_parts(body: dict) -> list[dict]:
    """The image and video content parts of a chat request, in order (pure)."""
    out = []
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else []:
        content = msg.get("content") if isinstance(msg, dict) else None
        for part in content if isinstance(content, list) else []:
            if isinstance(part, dict) and part.get("type") in _VISION:
                out.append(part)
    return out


def encode_body(body: dict, part: dict) -> dict:
    """An encoder instance's job for one media part of `body` (pure)."""
    out = {"model": body.get("model"), "messages": [{"role": "user", "content": [part]}], "max_tokens": 1,
           "stream": False}
    if body.get("mm_processor_kwargs") is not None:
        out["mm_processor_kwargs"] = body["mm_processor_kwargs"]
    return out


class _EPDMetrics(_Metrics):
    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.encode_jobs = Counter("vllm_neuron_proxy:encode_jobs", "Media items sent to encoder instances.",
                                   registry=r)
        self.ec_bytes = Counter("vllm_neuron_proxy:ec_bytes", "Embedding bytes the encoder instances wrote for "
                                "this proxy's requests.", registry=r)
        self.encode_fallbacks = Counter("vllm_neuron_proxy:encode_fallbacks", "Media items no encoder instance "
                                        "encoded (the prefill+decode instance computes or refuses them).",
                                        registry=r)


class EPDProxy(DisaggProxy):
    """The prefill+decode pool is DisaggProxy's decode pool (its relay and failover); encoders are our own."""

    def __init__(self, encode: list[str], pd: list[str], *, timeout_s: float = 600.0, encode_timeout_s: float = 60.0,
                 encode_attempts: int = 3, backoff_s: float = 5.0) -> None:
        self.encode = InstancePool("encode", encode, backoff_s=backoff_s)
        self.decode = InstancePool("pd", pd, backoff_s=backoff_s)
        self.prefill = self.encode
        if encode_attempts < 1:
            raise ValueError(f"--encode-attempts must be at least 1, got {encode_attempts}")
        self.encode_timeout_s, self.encode_attempts = encode_timeout_s, encode_attempts
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.metrics = _EPDMetrics()
        for pool in (self.encode, self.decode):
            for inst in pool.instances:
                self.metrics.outstanding.labels(pool.kind, inst.url).set(0)

    async def _encode_one(self, body: dict, part: dict, headers: dict) -> Response | None:
        """None when an encoder wrote the item or none could (the PD instance decides); an encoder's 4xx else."""
        self.metrics.encode_jobs.inc()
        for inst in self.encode.order()[:self.encode_attempts]:
            self._start(self.encode, inst)
            ok = False
            try:
                r = await self.client.post(inst.url + "/v1/chat/completions", json=encode_body(body, part),
                                           headers=headers, timeout=self.encode_timeout_s)
                if r.status_code >= 500:
                    logger.warning("encoder instance %s answered %d (%s); trying the next", inst.url, r.status_code,
                                   r.text[:200])
                    continue
                ok = True
                if r.status_code >= 400:
                    return Response(r.content, r.status_code, media_type="application/json")
                self.metrics.ec_bytes.inc((r.json().get("ec_transfer_params") or {}).get("bytes", 0))
                return None
            except (httpx.HTTPError, ValueError) as e:
                logger.warning("encoder instance %s failed (%s: %s); trying the next", inst.url, type(e).__name__, e)
            finally:
                self._finish(self.encode, inst, ok)
        self.metrics.encode_fallbacks.inc()
        logger.warning("no encoder instance encoded a media item of request %s; the prefill+decode instance "
                       "computes it or refuses the request", headers.get("X-Request-Id"))
        return None

    async def handle(self, path: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            return JSONResponse({"error": {"message": f"invalid JSON body: {e}", "type": "BadRequestError",
                                           "param": None, "code": 400}}, 400)
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        parts = media_parts(body) if path == "/v1/chat/completions" else []
        if parts:
            errors = await asyncio.gather(*(self._encode_one(body, p, headers) for p in parts))
            error = next((e for e in errors if e is not None), None)
            if error is not None:
                return error
        return await self._decode(path, body, headers)

    async def health(self) -> Response:
        up = {"encode": [i.url for i in self.encode.healthy()], "pd": [i.url for i in self.decode.healthy()]}
        return JSONResponse(up, 200 if up["pd"] else 503)


def run_epd_proxy(args) -> int:
    import uvicorn

    proxy = EPDProxy(args.encode, args.pd, timeout_s=args.timeout, encode_timeout_s=args.encode_timeout,
                     encode_attempts=args.encode_attempts)
    logger.info("epd-proxy on http://%s:%d: encode %s, prefill+decode %s", args.host, args.port,
                ", ".join(i.url for i in proxy.encode.instances), ", ".join(i.url for i in proxy.decode.instances))
    uvicorn.run(build_app(proxy, "vllm-neuron epd-proxy"), host=args.host, port=args.port, log_level="info")
    return 0
