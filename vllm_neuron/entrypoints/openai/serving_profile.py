"""POST /start_profile and /stop_profile (vLLM's routes): torch.profiler in every process of the engine
(vllm_neuron/profiler.py). Without VLLM_TORCH_PROFILER_DIR, or in a state that cannot honour the call (a profile
already running, none running), a 400 with the OpenAI error object and a log line."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from vllm_neuron.engine.protocol import EngineClient
from vllm_neuron.entrypoints.openai.errors import error_response
from vllm_neuron.entrypoints.openai.protocol import ErrorResponse
from vllm_neuron.logger import init_logger
from vllm_neuron.profiler import ProfilerError

logger = init_logger(__name__)

RESPONSES = {
    200: {"description": "Done; /stop_profile lists the trace files written (one per process)",
          "content": {"application/json": {"schema": {"type": "object"}}}},
    400: {"description": "Profiling is off (VLLM_TORCH_PROFILER_DIR unset), or a profile is already running "
                         "(start) / none is (stop)", "model": ErrorResponse},
    500: {"description": "The engine is dead", "model": ErrorResponse},
}


def install_profile_routes(app: FastAPI, engine: EngineClient) -> None:
    @app.post("/start_profile", responses=RESPONSES)
    async def start_profile() -> Response:
        try:
            await engine.start_profile()
        except ProfilerError as e:
            logger.warning("/start_profile refused: %s", e)
            return error_response(str(e), 400)
        logger.info("Profiling started (/start_profile)")
        return JSONResponse({"status": "started"})

    @app.post("/stop_profile", responses=RESPONSES)
    async def stop_profile() -> Response:
        try:
            traces = await engine.stop_profile()
        except ProfilerError as e:
            logger.warning("/stop_profile refused: %s", e)
            return error_response(str(e), 400)
        logger.info("Profiling stopped (/stop_profile): %d trace file(s): %s", len(traces), ", ".join(traces))
        return JSONResponse({"status": "stopped", "traces": traces})
