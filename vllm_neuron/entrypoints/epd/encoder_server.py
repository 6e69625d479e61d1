"""`vllm-neuron serve MODEL --mm-encoder-only --ec-transfer-config ...`: an EPD encoder instance's HTTP server.

`POST /v1/chat/completions` takes the epd-proxy's encode job (an OpenAI chat request; only its media parts and
`mm_processor_kwargs` matter), encodes the media the encoder cache lacks and writes every item's embeddings to
the EC connector, then answers an OpenAI chat completion with no text and `ec_transfer_params` (the items'
media hashes, bytes written, encode seconds). Media the processor refuses get a 400 naming the problem; a
connector that cannot write (a full disk) a 500 for that request only. `/health` answers once the encoder
buckets are warm, `/metrics` counts requests, items, bytes and encode time, `/v1/models` names the model.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from vllm_neuron.distributed.ec_transfer.record import ECTransferError
from vllm_neuron.engine.encoder_engine import EncoderEngine
from vllm_neuron.entrypoints.openai.chat_template import normalize_messages
from vllm_neuron.entrypoints.openai.errors import OpenAIError, error_response
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("vllm_neuron:ec_encode_requests", "Encode requests, by outcome (ok, bad_request, "
                                "transfer_error).", ["outcome"], registry=r)
        self.items = Counter("vllm_neuron:ec_items", "Media items of encode requests, by source (encoded: the "
                             "tower ran; cached: the encoder cache held them).", ["source"], registry=r)
        self.bytes = Counter("vllm_neuron:ec_bytes_written", "Embedding bytes written to the EC connector.",
                             registry=r)
        self.seconds = Histogram("vllm_neuron:ec_encode_seconds", "Seconds per encode request (processing, "
                                 "tower, connector write).", registry=r,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


def build_encoder_app(engine: EncoderEngine, served_name: str, api_key: str | None = None) -> FastAPI:
    """api_key: encode jobs need `Authorization: Bearer KEY` (the epd-proxy passes the client's on)."""
    metrics = _Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        engine.close()

    app = FastAPI(title="vllm-neuron encoder instance", lifespan=lifespan)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
            return error_response("Unauthorized: a valid API key is required (Authorization: Bearer KEY)", 401)
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
            media: dict[str, list] = {}
            normalize_messages(body.get("messages"), media)
            if not media:
                raise ValueError("an encode request needs image or video content parts; this is an EPD encoder "
                                 "instance (--mm-encoder-only), which generates no text")
            kwargs = body.get("mm_processor_kwargs")
            if kwargs is not None and not isinstance(kwargs, dict):
                raise ValueError("mm_processor_kwargs must be an object")
            result = await asyncio.to_thread(engine.encode, media, kwargs)
        except OpenAIError as e:
            metrics.requests.labels("bad_request").inc()
            return error_response(e.message, e.status_code, e.param)
        except ECTransferError as e:
            metrics.requests.labels("transfer_error").inc()
            logger.warning("encode request failed: %s", e)
            return error_response(str(e), 500)
        except ValueError as e:
            metrics.requests.labels("bad_request").inc()
            return error_response(str(e), 400, "messages")
        metrics.requests.labels("ok").inc()
        metrics.items.labels("encoded").inc(result.encoded)
        metrics.items.labels("cached").inc(result.cached)
        metrics.bytes.inc(result.bytes_written)
        metrics.seconds.observe(result.seconds)
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": served_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            "ec_transfer_params": {"mm_hashes": result.mm_hashes, "bytes": result.bytes_written,
                                   "encoded": result.encoded, "cached": result.cached,
                                   "encode_seconds": round(result.seconds, 6)}})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": served_name, "object": "model",
                                                         "owned_by": "vllm-neuron", "created": 0}]})

    return app


def run_encoder_server(engine_args, args) -> int:
    """`serve --mm-encoder-only`: the engine, warmed up, behind this server. TLS, the uvicorn log options and the
    API key apply as to `serve`; the options of the OpenAI server this one does not have are refused."""
    import os

    import uvicorn

    from vllm_neuron.engine.resolve import resolve_engine_config
    from vllm_neuron.entrypoints.cli.serve import check_port_free
    from vllm_neuron.entrypoints.openai.server_options import HttpOptions

    check_port_free(args.host, args.port)
    http = HttpOptions.from_args(args)
    unsupported = {"--root-path": http.root_path, "--enable-log-requests": http.enable_log_requests,
                   "--headless": getattr(args, "headless", False)}
    given = [flag for flag, value in unsupported.items() if value]
    if given:
        raise ValueError(f"{', '.join(given)} do(es) not apply to an EPD encoder instance (--mm-encoder-only), "
                         "which serves only the epd-proxy's encode jobs, /health and /metrics")
    api_key = getattr(args, "api_key", None) or os.environ.get("VLLM_API_KEY")
    config, ckpt = resolve_engine_config(engine_args)
    engine = EncoderEngine(config, ckpt)
    engine.warmup()
    name = config.served_names()[0]
    logger.info("EPD encoder instance on %s://%s:%d (%s)", "https" if http.tls else "http", args.host, args.port,
                config.ec_transfer_config.describe())
    uvicorn.run(build_encoder_app(engine, name, api_key), host=args.host, port=args.port, **http.uvicorn_kwargs())
    return 0
