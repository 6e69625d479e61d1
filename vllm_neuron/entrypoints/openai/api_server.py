"""The OpenAI-compatible HTTP app: routes, API-key check, error handlers, and a uvicorn runner.

`build_app` wires an `EngineClient` into a FastAPI app; it starts nothing. `serve_http` runs the
app with uvicorn and returns when the server shuts down (SIGINT/SIGTERM included), so that the
caller can stop the engine afterwards. `create_server` puts the HTTP edge around the app
(http_edge.py: no exception reaches uvicorn, uvicorn's own 400 is an OpenAI error object, the heap is
trimmed after large requests).
"""
from __future__ import annotations

import signal
import socket
from concurrent.futures import ThreadPoolExecutor
from types import FrameType
from collections.abc import Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from vllm_neuron import envs, metrics
from vllm_neuron.config.lora import LoRAModulePath
from vllm_neuron.engine.protocol import EngineClient
from vllm_neuron.entrypoints.openai import openapi_spec as spec
from vllm_neuron.entrypoints.openai.chat_template import load_chat_template
from vllm_neuron.entrypoints.openai.errors import error_response, install_exception_handlers
from vllm_neuron.entrypoints.openai.http_edge import (ApiKeyMiddleware, ExceptionGuard, HeapTrim, JsonErrorH11Protocol,
                                                      RequestIdMiddleware, RootPath)
from vllm_neuron.entrypoints.openai.request_body import read_json_body
from vllm_neuron.entrypoints.openai.request_logger import RequestLogger
from vllm_neuron.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from vllm_neuron.entrypoints.openai.request_policy import RequestLimits
from vllm_neuron.entrypoints.openai.protocol_audio import TranscriptionResponse
from vllm_neuron.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm_neuron.entrypoints.openai.serving_transcription import OpenAIServingTranscription
from vllm_neuron.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm_neuron.entrypoints.openai.responses_input import ResponsesRequest
from vllm_neuron.entrypoints.openai.responses_store import ResponseStore
from vllm_neuron.entrypoints.openai.serving_models import OpenAIServingModels
from vllm_neuron.entrypoints.openai.protocol_pooling import (ClassificationRequest, ClassificationResponse,
                                                             EmbeddingRequest, EmbeddingResponse, PoolingRequest,
                                                             PoolingResponse, RerankRequest, RerankResponse,
                                                             ScoreRequest, ScoreResponse)
from vllm_neuron.entrypoints.openai.serving_pooling import OpenAIServingPooling
from vllm_neuron.entrypoints.openai.serving_profile import install_profile_routes
from vllm_neuron.entrypoints.openai.serving_score import OpenAIServingScore
from vllm_neuron.entrypoints.openai.serving_responses import OpenAIServingResponses
from vllm_neuron.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllm_neuron.entrypoints.web_ui import install_web_ui, is_public_path
from vllm_neuron.logger import init_logger
from vllm_neuron.version import __version__

logger = init_logger(__name__)


def build_app(engine: EngineClient, *, served_model_names: list[str], api_key: str | None = None,
              chat_template: str | None = None, max_logprobs: int = 20, return_tokens_as_token_ids: bool = False,
              record_request_metrics: bool = True, allowed_origins: list[str] | None = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, responses_store_size: int = 0,
              limits: RequestLimits | None = None, api_key_all_routes: bool = False,
              allowed_methods: list[str] | None = None, allowed_headers: list[str] | None = None,
              allow_credentials: bool = False, root_path: str = "",
              request_logger: RequestLogger | None = None, web_ui: bool = True,
              lora_modules: Sequence[LoRAModulePath] = ()) -> FastAPI:
    """The OpenAI-compatible app serving `engine` under `served_model_names` (the first one is the
    default and the metrics' model_name label).

    chat_template: a Jinja template or a path to one; overrides the tokenizer's.
    max_logprobs: cap on logprobs/top_logprobs/prompt_logprobs (-1: the whole vocabulary).
    record_request_metrics: the HTTP layer records the per-request series (see vllm_neuron.metrics).
    enable_auto_tool_choice, tool_call_parser: tool_choice="auto" with that parser (vllm_neuron.tool_parsers).
    reasoning_parser: --reasoning-parser (vllm_neuron.reasoning; openai_gptoss: harmony).
    responses_store_size: responses /v1/responses keeps for previous_response_id and GET (0: none, --enable-store).
    limits: --max-n, --max-request-body-bytes, --trust-request-chat-template, --body-read-timeout.
    api_key_all_routes: the key guards every route but the liveness probes' (/metrics, /tokenize, the docs...).
    allowed_origins / allowed_methods / allowed_headers / allow_credentials: CORS, vLLM's defaults (any, any, any,
    no credentials).
    root_path: the path prefix a proxy serves the app under (--root-path); routes answer with and without it.
    request_logger: --enable-log-requests' lines (entrypoints/openai/request_logger.py).
    web_ui: the chat page at / and the dashboard at /dashboard (entrypoints/web_ui; --disable-webui: off).
    lora_modules: --lora-modules, the adapters served by name from the start (checked here: a bad one stops the
    start); VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 adds /v1/load_lora_adapter and /v1/unload_lora_adapter.
    """
    if max_logprobs < -1:
        raise ValueError(f"max_logprobs must be -1 (no cap) or >= 0, got {max_logprobs}")
    models = OpenAIServingModels(served_model_names, engine.model_info.model_path, engine.model_info.max_model_len,
                                 lora_modules, engine.lora_checker)
    metrics.configure(models.default_name, api_server=True)
    limits = limits or RequestLimits()
    # One pool for the blocking work (template rendering, tokenization) of every route.
    pool = ThreadPoolExecutor(2, thread_name_prefix="vllm-neuron-render")
    kwargs: dict[str, Any] = dict(max_logprobs=max_logprobs, chat_template=load_chat_template(chat_template),
                                  return_tokens_as_token_ids=return_tokens_as_token_ids,
                                  record_metrics=record_request_metrics, limits=limits, blocking_pool=pool,
                                  request_logger=request_logger)
    completion = OpenAIServingCompletion(engine, models, **kwargs)
    chat = OpenAIServingChat(engine, models, enable_auto_tool_choice=enable_auto_tool_choice,
                             tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser, **kwargs)
    tokenization = OpenAIServingTokenization(engine, models, **kwargs)
    pooling = OpenAIServingPooling(engine, models, **kwargs)
    scoring = OpenAIServingScore(engine, models, **kwargs)
    responses = OpenAIServingResponses(chat, ResponseStore(responses_store_size))
    transcription = OpenAIServingTranscription(engine, models, **kwargs)
    version = __version__

    app = FastAPI(title="vllm-neuron OpenAI-compatible server", version=version)
    app.state.root_path = root_path
    if api_key_all_routes and not api_key:
        raise ValueError("--api-key-all-routes needs an API key (--api-key or $VLLM_API_KEY)")
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, all_routes=api_key_all_routes,
                           public=is_public_path if web_ui else None)
    # Added after the key check, so outside it: CORS preflights are answered before the key check.
    app.add_middleware(CORSMiddleware, allow_origins=allowed_origins or ["*"], allow_credentials=allow_credentials,
                       allow_methods=allowed_methods or ["*"], allow_headers=allowed_headers or ["*"])
    app.add_middleware(RequestIdMiddleware)  # every answer, a 401 or a preflight too, carries the id
    if root_path:
        app.add_middleware(RootPath, root_path=root_path)  # outermost: the key check sees the route's own path
    install_exception_handlers(app)

    async def body(raw_request: Request) -> dict:
        return await read_json_body(raw_request, limits.max_body_bytes, limits.body_read_timeout_s)

    @app.get("/health", response_class=Response, responses=spec.HEALTH_RESPONSES)
    async def health() -> Response:
        if engine.errored:
            return error_response("The engine is dead.", 503)
        if not engine.is_ready:
            done = engine.warmup_progress
            return error_response("The server is not ready yet: warm-up and compilation are in progress"
                                  + (f" ({done[0]} of {done[1]} graphs)." if done else "."), 503)
        try:
            await engine.check_health()
        except Exception as e:  # any failure of the health check means not healthy
            return error_response(f"The engine is unhealthy: {e}", 503)
        return Response(status_code=200)

    # vLLM's (SageMaker's) liveness route: /health's answer, to GET and POST (one route each: one operation id each).
    for method in ("GET", "POST"):
        app.add_api_route("/ping", health, methods=[method], response_class=Response, responses=spec.HEALTH_RESPONSES)

    @app.get("/version", responses=spec.VERSION_RESPONSES)
    async def show_version() -> JSONResponse:
        return JSONResponse({"version": version})

    @app.get("/metrics", responses=spec.METRICS_RESPONSES)
    async def show_metrics() -> Response:
        return Response(content=metrics.metrics_response_body(), media_type=metrics.CONTENT_TYPE)

    @app.get("/v1/models", responses=spec.route_responses(ModelList, auth=bool(api_key)))
    async def show_models() -> JSONResponse:
        return JSONResponse(content=models.list_models().model_dump())

    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        @app.post("/v1/load_lora_adapter", response_class=Response,
                  responses=spec.route_responses(None, auth=bool(api_key)))
        async def load_lora_adapter(raw_request: Request) -> Response:
            return Response(models.load_lora_adapter(await body(raw_request)), media_type="text/plain")

        @app.post("/v1/unload_lora_adapter", response_class=Response,
                  responses=spec.route_responses(None, auth=bool(api_key)))
        async def unload_lora_adapter(raw_request: Request) -> Response:
            return Response(models.unload_lora_adapter(await body(raw_request)), media_type="text/plain")

    @app.post("/v1/completions", openapi_extra=spec.request_body(CompletionRequest),
              responses=spec.route_responses(CompletionResponse, stream=True, auth=bool(api_key)))
    async def create_completion(raw_request: Request) -> Response:
        return await completion.create_completion(await body(raw_request), raw_request)

    @app.post("/v1/audio/transcriptions", responses=spec.route_responses(TranscriptionResponse, stream=True,
                                                                          auth=bool(api_key)))
    async def create_transcription(raw_request: Request) -> Response:
        return await transcription.create(raw_request, "transcribe")

    @app.post("/v1/audio/translations", responses=spec.route_responses(TranscriptionResponse, stream=True,
                                                                        auth=bool(api_key)))
    async def create_translation(raw_request: Request) -> Response:
        return await transcription.create(raw_request, "translate")

    @app.post("/v1/chat/completions", openapi_extra=spec.request_body(ChatCompletionRequest),
              responses=spec.route_responses(ChatCompletionResponse, stream=True, auth=bool(api_key)))
    async def create_chat_completion(raw_request: Request) -> Response:
        return await chat.create_chat_completion(await body(raw_request), raw_request)

    # Pooling models (--runner pooling); a generative model answers them with a 400.
    pooling_routes = [("/v1/embeddings", EmbeddingRequest, EmbeddingResponse, pooling.create_embedding),
                      ("/pooling", PoolingRequest, PoolingResponse, pooling.create_pooling),
                      ("/classify", ClassificationRequest, ClassificationResponse, pooling.create_classify),
                      ("/score", ScoreRequest, ScoreResponse, scoring.create_score),
                      ("/v1/score", ScoreRequest, ScoreResponse, scoring.create_score),
                      ("/rerank", RerankRequest, RerankResponse, scoring.create_rerank),
                      ("/v1/rerank", RerankRequest, RerankResponse, scoring.create_rerank),
                      ("/v2/rerank", RerankRequest, RerankResponse, scoring.create_rerank)]
    def pooling_route(handler):  # one closure per route: FastAPI would read a default argument as a query field
        async def route(raw_request: Request) -> Response:
            return await handler(await body(raw_request), raw_request)
        return route

    for path, request_model, response_model, handler in pooling_routes:
        app.add_api_route(path, pooling_route(handler), methods=["POST"], openapi_extra=spec.request_body(request_model),
                          responses=spec.route_responses(response_model, auth=bool(api_key)))

    @app.post("/v1/responses", openapi_extra=spec.request_body(ResponsesRequest),
              responses=spec.route_responses(None, stream=True, auth=bool(api_key)))
    async def create_response(raw_request: Request) -> Response:
        return await responses.create_response(await body(raw_request), raw_request)

    @app.get("/v1/responses/{response_id}", responses=spec.route_responses(None, auth=bool(api_key)))
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(responses.retrieve(response_id))

    @app.post("/tokenize", openapi_extra=spec.request_body(TokenizeCompletionRequest, TokenizeChatRequest),
              responses=spec.route_responses(TokenizeResponse, auth=bool(api_key) and api_key_all_routes))
    async def tokenize(raw_request: Request) -> JSONResponse:
        result = await tokenization.tokenize(await body(raw_request))
        return JSONResponse(content=result.model_dump(exclude_none=True))

    @app.post("/detokenize", openapi_extra=spec.request_body(DetokenizeRequest),
              responses=spec.route_responses(DetokenizeResponse, auth=bool(api_key) and api_key_all_routes))
    async def detokenize(raw_request: Request) -> JSONResponse:
        return JSONResponse(content=(await tokenization.detokenize(await body(raw_request))).model_dump())

    install_profile_routes(app, engine)
    spec.install(app, limits, max_logprobs, len(engine.tokenizer))
    if web_ui:
        install_web_ui(app, root_path)

    app.state.engine = engine
    app.state.served_model_names = models.served_model_names
    return app


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGINT/SIGTERM after shutting down, which would kill the caller
    before it can stop the engine; here a signal only ends the serve loop."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True


def create_server(app: FastAPI, host: str, port: int, log_level: str = "info",
                  **uvicorn_kwargs: Any) -> uvicorn.Server:
    """uvicorn_kwargs: uvicorn.Config's (TLS files, access_log; server_options.HttpOptions.uvicorn_kwargs())."""
    uvicorn_kwargs.setdefault("http", JsonErrorH11Protocol)
    config = uvicorn.Config(ExceptionGuard(HeapTrim(app)), host=host, port=port, log_level=log_level,
                            **uvicorn_kwargs)
    return _Server(config)


async def serve_http(app: FastAPI, host: str, port: int, log_level: str = "info", *,
                     sock: socket.socket | None = None, **uvicorn_kwargs: Any) -> None:
    """Serves `app` until shutdown (signal or server.should_exit); returns afterwards.
    `sock`: an already bound socket (then host/port are only informative)."""
    server = create_server(app, host, port, log_level, **uvicorn_kwargs)
    await server.serve(sockets=[sock] if sock is not None else None)
