"""AsyncLLM: the API server's engine client. Input and output processing run here, in the server's
event loop; the EngineCore runs in its own (spawned) process behind two ZMQ sockets, so the HTTP loop
never runs the model.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import shutil
import tempfile
from collections.abc import AsyncGenerator
from typing import Any

import zmq
import zmq.asyncio

from vllm_neuron import metrics
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.config.generation_config import effective_generation_config
from vllm_neuron.engine.core_proc import run_engine_core
from vllm_neuron.engine.input_processor import InputProcessor, multimodal_processor
from vllm_neuron.engine.output_processor import OutputProcessor
from vllm_neuron.engine.protocol import EngineClient, EngineDeadError, EngineRequestError, ModelInfo, PromptType
from vllm_neuron.logger import init_logger
from vllm_neuron.model.loader import load_checkpoint, load_tokenizer
from vllm_neuron.model.registry import is_multimodal, model_spec
from vllm_neuron.outputs import RequestOutput
from vllm_neuron.sampling_params import SamplingParams

logger = init_logger(__name__)


class AsyncLLM(EngineClient):
    def __init__(self, config: EngineConfig, model_name: str | None = None) -> None:
        ckpt = load_checkpoint(config.model)
        spec = model_spec(ckpt.hf_config, config.neuron_config.quantization)  # bad models fail before spawning
        nc = config.finalize(ckpt.hf_config.get_text_config().max_position_embeddings, moe=spec.is_moe,
                             sliding_window=spec.has_sliding_window, multimodal=is_multimodal(ckpt.hf_config))
        self.config = config
        self.model_name = model_name or config.served_names()[0]
        self._queues: dict[str, asyncio.Queue] = {}
        self._ready = False
        self._dead: str | None = None
        self._handler: asyncio.Task | None = None
        self.startup_info: dict[str, Any] = {}

        self._ipc_dir = tempfile.mkdtemp(prefix="vllm_neuron_ipc_")
        in_addr, out_addr = (f"ipc://{os.path.join(self._ipc_dir, n)}" for n in ("in", "out"))
        self._sync_ctx = zmq.Context()
        self._input = self._sync_ctx.socket(zmq.PUSH)
        self._input.bind(in_addr)
        self._async_ctx = zmq.asyncio.Context()
        self._output = self._async_ctx.socket(zmq.PULL)
        self._output.bind(out_addr)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config, in_addr, out_addr, self.model_name), name="EngineCore", daemon=True)
        self.proc.start()
        logger.info("EngineCore process started (pid %d)", self.proc.pid)
        # The tokenizer loads while the engine process imports and loads the model (start-up overlap).
        try:
            self.tokenizer = load_tokenizer(config.tokenizer or ckpt, config.chat_template)
        except BaseException:
            self.proc.kill()
            self.shutdown()  # sockets and the IPC folder
            raise
        generation = effective_generation_config(config.generation_config, ckpt.generation_config,
                                                 config.override_generation_config)
        self.input_processor = InputProcessor(self.tokenizer, config.max_model_len, generation,
                                              nc.on_device_sampling_config, config.max_logprobs,
                                              ckpt.hf_config.get_text_config().vocab_size,
                                              multimodal_processor(config, ckpt))
        self.output_processor = OutputProcessor(self.tokenizer)
        self.model_info = ModelInfo(ckpt.path, config.max_model_len, self.input_processor.eos_token_id,
                                    self.input_processor.generation_defaults)

    # -- EngineClient -----------------------------------------------------------------------------
    @property
    def is_multimodal(self) -> bool:
        return self.input_processor.mm_processor is not None

    def process_multimodal(self, token_ids, media, mm_processor_kwargs=None):
        if self.input_processor.mm_processor is None:
            return super().process_multimodal(token_ids, media, mm_processor_kwargs)
        return self.input_processor.mm_processor.process(token_ids, media, mm_processor_kwargs)

    @property
    def is_ready(self) -> bool:
        return self._ready and self._dead is None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    async def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine process died: {self._dead}")

    def get_default_sampling_params(self) -> SamplingParams:
        return self.input_processor.default_sampling_params()

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str) -> AsyncGenerator[RequestOutput, None]:
        self._ensure_handler()
        await self.check_health()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, reqs = self.input_processor.process(request_id, prompt, sampling_params)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self.output_processor.add_request(request_id, text, ids, sampling_params, reqs)
        for r in reqs:
            self._send(("add", r))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # consumer went away (client disconnect) or the engine died
                self._abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    # -- internals ---------------------------------------------------------------------------------
    def _abort_now(self, request_id: str) -> None:
        ids = self.output_processor.engine_ids(request_id)
        if ids and self._dead is None:
            self._send(("abort", ids))
        self.output_processor.abort(request_id)
        q = self._queues.pop(request_id, None)
        if q is not None:
            q.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    def _send(self, msg: Any, block: bool = True) -> None:
        if self._dead is not None:
            return  # a PUSH to a dead peer would block forever
        self._input.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), flags=0 if block else zmq.NOBLOCK)

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(self._output_loop())

    async def start(self) -> None:
        """Starts reading engine outputs (call from the server's event loop)."""
        self._ensure_handler()

    async def wait_until_ready(self, timeout: float | None = None) -> None:
        self._ensure_handler()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while not self._ready:
            await self.check_health()
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError("engine did not become ready in time")
            await asyncio.sleep(0.05)

    async def _output_loop(self) -> None:
        while self._dead is None:
            if not await self._output.poll(200):
                if not self.proc.is_alive():
                    self._mark_dead(f"process exited with code {self.proc.exitcode}")
                continue
            kind, payload = pickle.loads(await self._output.recv())
            if kind == "outputs":
                self._dispatch(payload)
            elif kind == "ready":
                self._ready = True
                self.startup_info = payload
                # The EngineCore logged its own "Engine ready" line with the details: no second one.
                logger.debug("EngineCore reported ready (startup %.1f s)", payload["startup_seconds"])
            elif kind == "dead":
                self._mark_dead(payload)

    def _dispatch(self, outs) -> None:
        # One request's outputs at a time: an error while detokenizing one fails that request only,
        # never this loop (which every request in flight depends on).
        by_request: dict[str | None, list] = {}
        for out in outs.outputs:
            if out.error is not None:
                self._fail_request(out.request_id, out.error)
            else:
                by_request.setdefault(self.output_processor.parent_of.get(out.request_id), []).append(out)
        for group in by_request.values():
            try:
                results, to_abort = self.output_processor.process(group)
            except Exception as e:  # noqa: BLE001
                logger.exception("output processing failed for request %s", group[0].request_id)
                self._fail_request(group[0].request_id, f"{type(e).__name__}: {e}")
                continue
            if to_abort:
                self._send(("abort", to_abort, "stop"))
            for res in results:
                q = self._queues.get(res.request_id)
                if q is not None:
                    q.put_nowait(res)

    def _fail_request(self, engine_request_id: str, error: str) -> None:
        """The engine failed one completion: the whole request fails with the error (its other
        completions are aborted); the engine goes on."""
        parent = self.output_processor.parent_of.get(engine_request_id)
        if parent is None:
            return
        q = self._queues.pop(parent, None)
        ids = self.output_processor.engine_ids(parent)
        if ids:
            self._send(("abort", ids))
        self.output_processor.abort(parent)
        if q is not None:
            q.put_nowait(EngineRequestError(f"the engine failed this request: {error}"))

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        self._dead = reason
        logger.error("EngineCore is dead: %s", reason)
        err = EngineDeadError(f"the engine process died: {reason}")
        for q in self._queues.values():
            q.put_nowait(err)

    def shutdown(self) -> None:
        if self.proc.is_alive():
            try:
                self._send(("shutdown",), block=False)
            except zmq.ZMQError:  # zmq.Again: the core is gone or not listening; terminate() below
                pass
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(timeout=5)
        if self.proc.pid is not None:
            metrics.mark_process_dead(self.proc.pid)
        if self._handler is not None:
            self._handler.cancel()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
