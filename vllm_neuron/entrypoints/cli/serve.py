"""`vllm-neuron serve`: the API server process plus its EngineCore process(es); `--headless`: only a node's
data-parallel replicas (engine/dp_node.py) or, with --nnodes > 1, its tensor-parallel ranks (worker/tp_executor.py)."""
from __future__ import annotations

import argparse
import asyncio
import os
import time

from vllm_neuron.config.arg_utils import engine_args_from_cli
from vllm_neuron.entrypoints.openai.request_policy import RequestLimits
from vllm_neuron.entrypoints.openai.server_options import HttpOptions, check_port_free
from vllm_neuron.logger import init_logger
from vllm_neuron.proc_lifecycle import before_exit, install_stack_dumps

logger = init_logger(__name__)

_ENGINE_WATCH_SECONDS = 0.2


def responses_store_size(args: argparse.Namespace) -> int:
    """How many /v1/responses answers the server keeps: none unless --enable-store or
    VLLM_ENABLE_RESPONSES_API_STORE=1 (vLLM's opt-in), then --responses-store-size."""
    from vllm_neuron import envs

    if not (getattr(args, "enable_store", False) or envs.VLLM_ENABLE_RESPONSES_API_STORE):
        return 0
    size = getattr(args, "responses_store_size", 1000)
    if size < 1:
        raise ValueError(f"--responses-store-size must be >= 1, got {size}")
    return size


def run_serve(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    if not getattr(args, "headless", False):  # a headless node serves no HTTP
        check_port_free(args.host, args.port)
    responses_store_size(args)  # a bad size fails before the model loads
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    limits = RequestLimits(args.max_n, args.max_request_body_bytes, args.trust_request_chat_template,
                           args.body_read_timeout)
    engine_args = engine_args_from_cli(args)
    if engine_args.mm_encoder_only:  # an EPD encoder instance: the vision tower behind its own small server
        from vllm_neuron.entrypoints.epd.encoder_server import run_encoder_server

        return run_encoder_server(engine_args, args)
    if getattr(args, "headless", False):
        if engine_args.nnodes > 1:
            from vllm_neuron.engine.resolve import resolve_engine_config
            from vllm_neuron.worker.tp_executor import run_headless_ranks

            return run_headless_ranks(resolve_engine_config(engine_args)[0])
        from vllm_neuron.engine.dp_node import run_headless

        return run_headless(engine_args)
    if engine_args.data_parallel_start_rank != 0:
        raise ValueError(f"--data-parallel-start-rank {engine_args.data_parallel_start_rank} is for --headless "
                         "nodes; the head (the API server) runs ranks 0 .. --data-parallel-size-local - 1")
    if engine_args.node_rank != 0:
        raise ValueError(f"--node-rank {engine_args.node_rank} is for --headless nodes; node 0 runs the API server")
    api_key = args.api_key or os.environ.get("VLLM_API_KEY")
    if args.api_key_all_routes and not api_key:
        raise ValueError("--api-key-all-routes needs an API key: pass --api-key KEY or set $VLLM_API_KEY")
    http = HttpOptions.from_args(args)  # a wrong TLS file fails here, before the engine loads
    from vllm_neuron.engine.resolve import fetch_hub_models

    # Before the event loop: asyncio.run turns the first Ctrl-C into a cancellation a blocking download never sees.
    engine_args = fetch_hub_models(engine_args)
    install_stack_dumps()
    code = asyncio.run(_serve(engine_args, args, api_key, limits, http, t0))
    before_exit()
    return code


async def _serve(engine_args, args: argparse.Namespace, api_key: str | None, limits: RequestLimits,
                 http: HttpOptions, t0: float) -> int:
    from vllm_neuron import metrics
    from vllm_neuron.engine.async_llm import AsyncLLM
    from vllm_neuron.engine.protocol import EngineDeadError
    from vllm_neuron.entrypoints.openai.api_server import build_app, create_server

    engine = AsyncLLM.from_engine_args(engine_args)  # resolved here, in the API server process
    config = engine.config
    try:
        names = config.served_names()
        app = build_app(engine, served_model_names=names, api_key=api_key, chat_template=config.chat_template,
                        max_logprobs=config.max_logprobs,
                        enable_auto_tool_choice=getattr(args, "enable_auto_tool_choice", False),
                        tool_call_parser=getattr(args, "tool_call_parser", None),
                        reasoning_parser=getattr(args, "reasoning_parser", None),
                        responses_store_size=responses_store_size(args),
                        limits=limits, api_key_all_routes=args.api_key_all_routes,
                        lora_modules=config.lora_module_paths, **http.app_kwargs())
        await engine.start()

        server = create_server(app, args.host, args.port, **http.uvicorn_kwargs())
        exit_code = 0

        host = f"[{args.host}]" if ":" in args.host else args.host
        url = f"{http.scheme}://{host}:{args.port}{http.root_path}"

        async def _watch_engine() -> None:
            nonlocal exit_code
            try:
                # uvicorn's "Application startup complete" comes within a second; the engine's warm-up (kernels,
                # bucket graphs) takes seconds to minutes more: say so right after uvicorn's lines.
                while not server.started and not engine.is_ready:
                    await asyncio.sleep(0.05)
                if not engine.is_ready:
                    logger.info("The HTTP server listens on %s, but the engine is still warming up (loading or "
                                "compiling its bucket graphs): /health answers 503 until the 'Ready' line below",
                                url)
                await engine.wait_until_ready()
            except EngineDeadError as e:
                # Startup failed (bad KV budget, compile-cache miss under DISABLE_WARMUP_COMPILE, ...):
                # the server must not linger with /health 503 forever.
                logger.error("Engine failed to start, shutting down: %s", e)
                exit_code = 1
                server.should_exit = True
                return
            while not server.started:  # an engine whose graphs were all cached can beat uvicorn's start-up
                await asyncio.sleep(0.05)
            seconds = time.perf_counter() - t0
            metrics.record_startup_time(seconds)
            logger.info("Ready in %.1f s: %s/v1 serves %s (/health answers 200)", seconds, url, names[0])
            if http.web_ui:
                logger.info("Web UI: %s/ (chat) and %s/dashboard (--disable-webui turns them off)", url, url)
            while not engine.errored:
                await asyncio.sleep(_ENGINE_WATCH_SECONDS)
            # vLLM's behaviour: a server without its engine exits, so that a supervisor restarts both.
            # Requests in flight have their error already; uvicorn lets them finish before exiting.
            logger.error("The engine process died (%s); the API server exits with code 1 so that a supervisor "
                         "can restart it.", engine.dead_reason)
            exit_code = 1
            server.should_exit = True

        ready_task = asyncio.create_task(_watch_engine())
        await server.serve()
        ready_task.cancel()
        return exit_code
    finally:
        engine.shutdown()
