"""AsyncLLM: the API server's engine client. Input and output processing run here, in the server's
event loop; the EngineCore replicas run in their own (spawned) processes behind one ZMQ socket
(engine/core_client.py), so the HTTP loop never runs the model.

With --data-parallel-size N there are N replicas; each request goes to one of them (engine/dp_router.py:
least outstanding work, prefix affinity), and its outputs, aborts and failure stay with that replica.
A replica that dies fails its own requests with EngineDeadError; the others keep serving, /health
reports the dead one, and the server exits once none is left.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from typing import Any

from vllm_neuron import metrics, profiler
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.config.generation_config import effective_generation_config
from vllm_neuron.engine.core_client import CoreClient
from vllm_neuron.engine.dp_router import DPRouter
from vllm_neuron.engine.input_processor import (InputProcessor, logits_processor_classes, multimodal_processor,
                                                lora_checker, prompt_embeds_spec)
from vllm_neuron.engine.output_processor import OutputProcessor
from vllm_neuron.engine.admission import AdmissionControl
from vllm_neuron.engine.protocol import (AdmissionTicket, EngineClient, EngineDeadError, EngineOverloadedError,
                                         EngineRequestError, ModelInfo, PromptType)
from vllm_neuron.logger import init_logger
from vllm_neuron.engine.resolve import resolve_engine_config
from vllm_neuron.model.loader import Checkpoint, load_checkpoint, load_tokenizer
from vllm_neuron.lora.request import LoRARequest
from vllm_neuron.outputs import PoolingRequestOutput, RequestOutput
from vllm_neuron.pooling_params import PoolingParams
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.structured_output.checker import GrammarChecker, GrammarCompilerBusy
from vllm_neuron.structured_output import GRAMMAR_BUSY, GRAMMAR_INVALID

logger = init_logger(__name__)

_LIVENESS_S = 0.2  # how often replica processes and node heartbeats are checked
_WAIT_NOTE_S = 30.0  # how often start-up names the remote ranks that have not joined yet


class AsyncLLM(EngineClient):
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None,
                 model_name: str | None = None) -> None:
        """`config` is resolved (from_engine_args does it here); the engine processes get it as it is."""
        ckpt = checkpoint or load_checkpoint(config.model)
        nc = config.neuron_config
        self.config = config
        self.model_name = model_name or config.served_names()[0]
        self._queues: dict[str, asyncio.Queue] = {}
        self._replica_of: dict[str, int] = {}  # request id -> the replica serving it
        self._weight: dict[str, int] = {}  # request id -> engine requests it holds (n)
        self._ready = False
        self._warmup: dict[int, tuple[int, int]] = {}  # replica rank -> (graphs warmed up, graphs in all)
        self._dead: str | None = None
        self._handler: asyncio.Task | None = None
        self.startup_info: dict[str, Any] = {}
        # Profiling: this process' trace, the tag of the profile in progress, the replicas' pending answers.
        self._trace = profiler.TraceSession()
        self._trace_tag: str | None = None
        self._profile_waiters: dict[int, asyncio.Future] = {}
        # A replica with a full batch more in flight than the least loaded one gives up its prefix affinity.
        self.router = DPRouter(config.data_parallel_size, config.block_size, imbalance=config.max_num_seqs)
        self.cores = CoreClient(config, self.model_name)
        # The tokenizer loads while the engine processes import and load the model (start-up overlap).
        try:
            self.tokenizer = load_tokenizer(config.tokenizer or ckpt, config.chat_template)
        except BaseException:
            self.cores.shutdown()
            raise
        generation = effective_generation_config(config.generation_config, ckpt.generation_config,
                                                 config.override_generation_config)
        vocab_size = ckpt.hf_config.get_text_config().vocab_size
        # Grammars compile in a child process of their own, under the time limit (structured_output/checker.py).
        self.grammar_checker = GrammarChecker(self.tokenizer, vocab_size, config.grammar_limits)
        self.admission = AdmissionControl(config.max_num_queued_reqs, metrics.record_admission)
        self.input_processor = InputProcessor(self.tokenizer, config.max_model_len, generation,
                                              nc.on_device_sampling_config, config.max_logprobs, vocab_size,
                                              multimodal_processor(config, ckpt, self.tokenizer),
                                              grammar_check=self.grammar_checker.check,
                                              scheduling_policy=config.scheduling_policy,
                                              kv_transfer=config.kv_transfer is not None,
                                              prompt_embeds=prompt_embeds_spec(config, ckpt),
                                              logits_processors=logits_processor_classes(config),
                                              pooling=config.pooling, lora=lora_checker(config, ckpt))
        self.output_processor = OutputProcessor(self.tokenizer)
        embeds = self.input_processor.prompt_embeds
        self.model_info = ModelInfo(ckpt.path, config.max_model_len, self.input_processor.eos_token_id,
                                    self.input_processor.generation_defaults, embeds[0] if embeds else None,
                                    config.pooling)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, model_name: str | None = None) -> "AsyncLLM":
        """Resolves `args` in this process (bad options and unsupported models fail before any engine process
        starts), then starts the engines."""
        config, ckpt = resolve_engine_config(args)
        return cls(config, ckpt, model_name)

    # -- EngineClient -----------------------------------------------------------------------------
    @property
    def lora_checker(self):
        return self.input_processor.lora

    def admit(self, weight: int) -> AdmissionTicket:
        return self.admission.admit(weight)

    def check_structured_outputs(self, params: Any, max_tokens: int | None = None) -> None:
        checker = self.grammar_checker
        timeouts = checker.compile_timeouts
        try:
            checker.check(params, max_tokens)
        except GrammarCompilerBusy as e:
            metrics.record_admission(self.admission.admitted, "grammar_busy")
            raise EngineOverloadedError(str(e), retry_after_s=max(1, int(checker.limits.compile_timeout_s)),
                                        reason="grammar_busy") from None
        finally:
            metrics.record_grammar_cache("api_server", checker.cache_bytes)
            if checker.compile_timeouts > timeouts:
                metrics.record_grammar_timeout("api_server", checker.compile_timeouts - timeouts)

    @property
    def is_multimodal(self) -> bool:
        return self.input_processor.mm_processor is not None

    @property
    def audio_processor(self):
        proc = self.input_processor.mm_processor
        return proc if "audio" in getattr(proc, "modalities", ()) else None

    def process_multimodal(self, token_ids, media, mm_processor_kwargs=None):
        if self.input_processor.mm_processor is None:
            return super().process_multimodal(token_ids, media, mm_processor_kwargs)
        return self.input_processor.mm_processor.process(token_ids, media, mm_processor_kwargs)

    @property
    def warmup_progress(self) -> tuple[int, int] | None:
        """(graphs warmed up, graphs in all) over the replicas that reported any; None before the first."""
        if not self._warmup:
            return None
        return sum(d for d, _ in self._warmup.values()), sum(t for _, t in self._warmup.values())

    @property
    def is_ready(self) -> bool:
        """Every replica finished its start-up, and one at least still serves."""
        return self._ready and self._dead is None

    @property
    def errored(self) -> bool:
        """No replica is left: the server cannot serve (it exits)."""
        return self._dead is not None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    async def check_health(self) -> None:
        """Raises EngineDeadError when any replica is dead (the survivors still serve requests)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine process died: {self._dead}")
        dead = self.cores.dead_reasons()
        if dead:
            raise EngineDeadError("; ".join(f"data parallel replica {r} died: {why}" for r, why in dead.items()))

    def replica_of(self, request_id: str) -> int | None:
        """The data-parallel replica serving an in-flight request (None when unknown or finished)."""
        return self._replica_of.get(request_id)

    def get_default_sampling_params(self) -> SamplingParams:
        return self.input_processor.default_sampling_params()

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams, request_id: str,
                     priority: int = 0) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling engine's request: one PoolingRequestOutput, when its prompt has been pooled."""
        async for out in self.generate(prompt, pooling_params, request_id, priority):
            yield out

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | PoolingParams, request_id: str,
                       priority: int = 0, lora_request: LoRARequest | None = None,
                       ) -> AsyncGenerator[RequestOutput, None]:
        self._ensure_handler()
        if self._dead is not None:
            raise EngineDeadError(f"the engine process died: {self._dead}")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, reqs = self.input_processor.process(request_id, prompt, sampling_params, priority, lora_request)
        q: asyncio.Queue = asyncio.Queue()
        decision = self.router.route(ids, weight=len(reqs))
        if self.router.loads[decision.replica] == len(reqs):
            self.cores.got_work(decision.replica)
        self._queues[request_id] = q
        self._replica_of[request_id] = decision.replica
        self._weight[request_id] = len(reqs)
        self.output_processor.add_request(request_id, text, ids, sampling_params, reqs)
        logger.debug("request %s -> replica %d (%s, %d cached blocks)", request_id, decision.replica,
                     decision.reason, decision.matched_blocks)
        for r in reqs:
            if not self.cores.send(decision.replica, ("add", r)):
                self._fail_replica_request(request_id, decision.replica, "it is unreachable")
                break
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
            self._release(request_id)

    async def abort(self, request_id: str) -> None:
        self._abort_now(request_id)

    # -- internals ---------------------------------------------------------------------------------
    def _release(self, request_id: str) -> None:
        rank = self._replica_of.pop(request_id, None)
        if rank is not None:
            self.router.finished(rank, self._weight.pop(request_id, 1))

    def _abort_now(self, request_id: str) -> None:
        ids = self.output_processor.engine_ids(request_id)
        rank = self._replica_of.get(request_id)
        if ids and rank is not None:
            self._send(("abort", ids), rank)
        self.output_processor.abort(request_id)
        q = self._queues.pop(request_id, None)
        if q is not None:
            q.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    # -- profiling (vllm_neuron/profiler.py) -----------------------------------------------------------------
    async def start_profile(self) -> None:
        profiler.trace_dir()  # ProfilerError when profiling is off
        if self._trace_tag is not None:
            raise profiler.ProfilerError("a profile is already running: stop it first (/stop_profile)")
        tag = profiler.new_tag()
        self._trace.start("api_server", tag)
        self._trace_tag = tag
        try:
            await self._profile_replicas("start", tag)
        except BaseException:
            self._trace_tag = None
            self._trace.stop()
            with contextlib.suppress(Exception):  # the replicas that did start
                await self._profile_replicas("stop", tag)
            raise

    async def stop_profile(self) -> list[str]:
        if self._trace_tag is None:
            raise profiler.ProfilerError("no profile is running: start one first (/start_profile)")
        tag, self._trace_tag = self._trace_tag, None
        try:
            await self._profile_replicas("stop", tag)
        finally:
            self._trace.stop()
        return profiler.trace_files(tag)

    async def _profile_replicas(self, action: str, tag: str) -> None:
        """Asks every live replica to start / stop its profile and waits for their answers (the first error
        raised as a ProfilerError)."""
        loop = asyncio.get_running_loop()
        self._ensure_handler()
        waiters = {}
        for rank, alive in enumerate(self.cores.alive()):
            if alive and self.cores.send(rank, ("profile", action, tag, rank)):
                waiters[rank] = self._profile_waiters[rank] = loop.create_future()
        errors = []
        for rank, fut in waiters.items():
            try:
                error = await fut
            finally:
                self._profile_waiters.pop(rank, None)
            if error is not None:
                errors.append(f"engine {rank}: {error}")
        if errors:
            raise profiler.ProfilerError("; ".join(errors))

    def _send(self, msg: Any, rank: int) -> None:
        self.cores.send(rank, msg)  # a dead replica gets nothing: its requests have failed already

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
        next_note = loop.time() + _WAIT_NOTE_S
        while not self._ready:
            if self._dead is not None or self.cores.dead_reasons():
                await self.check_health()  # a replica that dies during start-up fails the start
            if deadline is not None and loop.time() > deadline:
                raise TimeoutError("engine did not become ready in time")
            if loop.time() > next_note and self.cores.remote_address is not None:
                absent = [r.rank for r in self.cores.replicas if r.proc is None and not r.connected]
                if absent:  # a node that was never started, or cannot reach the head
                    logger.info("Waiting for data parallel ranks %s to join at %s", absent, self.cores.remote_address)
                next_note = loop.time() + _WAIT_NOTE_S
            await asyncio.sleep(0.05)

    async def _output_loop(self) -> None:
        next_check = 0.0
        while self._dead is None:
            got = await self.cores.poll(int(_LIVENESS_S * 1000))
            now = time.monotonic()
            if now >= next_check:  # also while outputs stream without a pause
                next_check = now + _LIVENESS_S
                for rank, reason in self.cores.check_liveness(self.router.loads, now):
                    self._replica_died(rank, reason)
            if not got:
                continue
            rank, (kind, *rest) = await self.cores.recv()
            self._on_message(rank, kind, rest[0] if rest else None)

    def _on_message(self, rank: int | None, kind: str, payload) -> None:
        """One message from a replica (engine/core_proc.py lists them) or a node supervisor."""
        if kind == "outputs":
            self._dispatch(payload, rank)
        elif kind == "progress":
            self._warmup[rank] = (payload["done"], payload["total"])
        elif kind == "ready":
            self._on_ready(rank, payload)
        elif kind == "profiled":
            fut = self._profile_waiters.get(rank)
            if fut is not None and not fut.done():
                fut.set_result(payload)
        elif kind == "dead":
            self._replica_died(rank, payload)
        elif kind == "node_dead":
            for r, reason in payload:
                self._replica_died(r, reason)

    def _on_ready(self, rank: int, info: dict) -> None:
        # The EngineCore logged its own "Engine ready" line with the details: no second one.
        logger.debug("EngineCore %d reported ready (startup %.1f s)", rank, info["startup_seconds"])
        if rank == 0 or not self.startup_info:
            self.startup_info = info
        if all(r.ready or r.dead is not None for r in self.cores.replicas):
            self._ready = True
            if self.cores.size > 1:
                logger.info("All %d data parallel replicas are ready", self.cores.size)

    def _dispatch(self, outs, rank: int = 0) -> None:
        # One request's outputs at a time: an error while detokenizing one fails that request only,
        # never this loop (which every request in flight depends on).
        by_request: dict[str | None, list] = {}
        for out in outs.outputs:
            if out.error is not None:
                self._fail_request(out.request_id, out.error, rank, out.error_kind)
            else:
                by_request.setdefault(self.output_processor.parent_of.get(out.request_id), []).append(out)
        for group in by_request.values():
            try:
                results, to_abort = self.output_processor.process(group)
            except Exception as e:  # noqa: BLE001
                logger.exception("output processing failed for request %s", group[0].request_id)
                self._fail_request(group[0].request_id, f"{type(e).__name__}: {e}", rank)
                continue
            if to_abort:
                self._send(("abort", to_abort, "stop"), rank)
            for res in results:
                q = self._queues.get(res.request_id)
                if q is not None:
                    q.put_nowait(res)

    def _fail_request(self, engine_request_id: str, error: str, rank: int = 0, kind: str | None = None) -> None:
        """The engine failed one completion: the whole request fails with the error (its other
        completions are aborted); the engine goes on."""
        parent = self.output_processor.parent_of.get(engine_request_id)
        if parent is None:
            return
        q = self._queues.pop(parent, None)
        ids = self.output_processor.engine_ids(parent)
        if ids:
            self._send(("abort", ids), rank)
        self.output_processor.abort(parent)
        if q is not None:
            q.put_nowait(_request_error(error, kind))

    def _fail_replica_request(self, request_id: str, rank: int, why: str) -> None:
        self.output_processor.abort(request_id)
        q = self._queues.pop(request_id, None)
        if q is not None:
            q.put_nowait(self._replica_error(rank, why))

    def _replica_error(self, rank: int, why: str) -> EngineDeadError:
        if self.cores.size == 1:
            return EngineDeadError(f"the engine process died: {why}")
        return EngineDeadError(f"data parallel replica {rank} died: {why}")

    def _replica_died(self, rank: int, reason: str) -> None:
        """A replica is gone: its requests fail now, the router stops choosing it; the last one ends the
        engine."""
        if not self.cores.mark_dead(rank, reason):
            return
        self.router.mark_dead(rank)
        mine = [rid for rid, r in self._replica_of.items() if r == rank]
        if self.cores.size == 1:
            logger.error("EngineCore is dead: %s", reason)
        else:
            logger.error("Data parallel replica %d is dead (%s): %d request(s) in flight on it fail; /health "
                         "reports it; %d replica(s) still serve", rank, reason, len(mine),
                         sum(self.cores.alive()))
        err = self._replica_error(rank, reason)
        fut = self._profile_waiters.get(rank)
        if fut is not None and not fut.done():
            fut.set_exception(err)
        for rid in mine:
            self.output_processor.abort(rid)
            q = self._queues.pop(rid, None)
            if q is not None:
                q.put_nowait(err)
        if self.cores.all_dead:
            self._dead = reason if self.cores.size == 1 else "every data parallel replica died (" + \
                "; ".join(f"{r}: {why}" for r, why in self.cores.dead_reasons().items()) + ")"
            for q in self._queues.values():
                q.put_nowait(EngineDeadError(f"the engine process died: {self._dead}"))
        elif not self._ready and all(r.ready or r.dead is not None for r in self.cores.replicas):
            self._ready = True

    def shutdown(self) -> None:
        if self._handler is not None:
            self._handler.cancel()
        self.grammar_checker.close()
        self.cores.shutdown()


def _request_error(error: str, kind: str | None) -> Exception:
    """What the engine's failure of one request raises in its stream: ValueError for the request's own fault
    (a 400: its grammar failed or compiled too long), EngineOverloadedError for the engine's capacity (503)."""
    if kind == GRAMMAR_INVALID:
        return ValueError(error)
    if kind == GRAMMAR_BUSY:
        return EngineOverloadedError(error, reason="grammar_busy")
    return EngineRequestError(f"the engine failed this request: {error}")
