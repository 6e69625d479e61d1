"""EngineCore: builds the model runner and the scheduler, then runs schedule -> execute -> update."""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from vllm_neuron import envs, profiler
from vllm_neuron.config import buckets as B
from vllm_neuron.config.compatibility import V2_LOG_LINE
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.core.prefill_batching import step_overhead_tokens
from vllm_neuron.core.request import Request, RequestStatus
from vllm_neuron.core.scheduler import Scheduler, SchedulerConfig
from vllm_neuron.core.kv_tier import KVTierScheduler
from vllm_neuron.engine.kv_tier import KVTierEngine, model_key
from vllm_neuron.engine.kv_transfer import KVTransferEngine
from vllm_neuron.engine.prompt_embeds import embeds_digest
from vllm_neuron.engine.served_shapes import SUMMARY_NAME, ServedShapes, engine_limits, engine_lists
from vllm_neuron.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from vllm_neuron.frame_stack import call_with_room
from vllm_neuron.logger import init_logger
from vllm_neuron.step import ModelRunnerOutput, SchedulerOutput
from vllm_neuron.model.loader import Checkpoint, load_checkpoint
from vllm_neuron.worker import memory
from vllm_neuron.worker.parallel_compile import compile_missing
from vllm_neuron.worker.runner_factory import create_runner
from vllm_neuron.worker.tp_executor import TPExecutor, WorkerRankError

logger = init_logger(__name__)
# The longest an engine with nothing to run waits on a grammar compile within one step (a message that arrives
# meanwhile waits as long).
GRAMMAR_IDLE_WAIT_S = 0.01

BATCH_QUEUE_DEPTH = 2  # seeds: the engine schedules one step ahead of the one executing
# A request in this many failed steps is failed itself; this many failed steps in a row is an engine
# fault, not a request's, and ends the process (the server then exits, see entrypoints/cli/serve.py).
MAX_STEP_FAILURES_PER_REQUEST = 2
MAX_CONSECUTIVE_STEP_FAILURES = 4


class EngineCore:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None,
                 on_progress: Callable[[int, int, str], None] | None = None) -> None:
        """`config` comes resolved (engine/resolve.py, in the process that got the user's options); the engine
        core only loads the checkpoint's weights. on_progress(done, total, how): each graph of warm-up."""
        if not isinstance(config, EngineConfig):
            raise TypeError(f"EngineCore takes a resolved EngineConfig (engine/resolve.py), got {type(config).__name__}")
        if config.mm_encoder_only:
            raise ValueError("mm_encoder_only builds an EPD encoder instance, which has no language model to "
                             "generate with: start it with `vllm-neuron serve MODEL --mm-encoder-only`")
        t0 = time.perf_counter()
        self.config = config
        self.ckpt = checkpoint or load_checkpoint(config.model)
        nc = config.neuron_config
        self.device = config.torch_device
        self.dtype = config.torch_dtype
        logger.info("dtype %s (%s)", config.dtype, config.dtype_reason)
        backend = config.backend
        logger.info("Engine config: model=%s device=%s dtype=%s max_model_len=%d max_num_seqs=%d "
                    "max_num_batched_tokens=%d block_size=%d prefix_caching=%s sampling=%s",
                    self.ckpt.path, self.device, self.dtype, config.max_model_len, config.max_num_seqs,
                    config.max_num_batched_tokens, config.block_size, config.enable_prefix_caching,
                    "on-device" if nc.on_device_sampling else "CPU")
        if config.pooling is not None:
            logger.info("%s; prefill graphs only, prefix caching off", config.pooling.describe())
        env = envs.describe()
        if env:
            logger.info("Environment: %s", env)
        choice = config.runner_choice
        if choice.log_message():
            (logger.warning if choice.use_v2 else logger.info)("%s", choice.log_message())
        if choice.model_reason():
            logger.info("%s", choice.model_reason())
        if config.use_v2_model_runner:
            logger.info("%s", V2_LOG_LINE)
        if config.world_size > 1:
            # Rank 0 here; the executor replays every runner call on the other ranks (every stage's).
            self.runner = TPExecutor(config, self.ckpt, self.device, self.dtype, backend)
        else:
            self.runner = create_runner(config, self.ckpt, self.device, self.dtype, backend)
        logger.info("%s", B.format_bucket_table(nc.num_batched_tokens_buckets,
                                                () if config.pooling is not None else nc.num_seqs_buckets,
                                                nc.context_buckets, self.runner.prefill_needs_context()))
        self.load_stats = self.runner.load_model()
        self.num_blocks = self.runner.num_blocks(self.load_stats.nbytes)
        self.runner.init_kv_cache(self.num_blocks)
        logger.info(memory.capacity_summary(self.num_blocks - 1, config.block_size, config.max_model_len,
                                            self.runner.request_blocks()))
        if not isinstance(self.runner, TPExecutor):  # (tensor parallelism refuses compile workers)
            compile_missing(self.runner)
        self.compiler = self.runner.warmup(on_progress)
        self.kv_transfer = KVTransferEngine(config.kv_transfer, tp_size=config.tensor_parallel_size,
                                            block_size=config.block_size, call=self._runner_call) \
            if config.kv_transfer is not None else None
        self.kv_tier = None
        if config.kv_offload is not None:
            folder = self.runner.kv_tier_open(config.kv_offload, model_key(config, self.ckpt))
            self.kv_tier = KVTierEngine(config.kv_offload, folder, call=self._runner_call)
        overhead = step_overhead_tokens(self.device.type)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, block_size=config.block_size, num_blocks=self.num_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            max_prefill_context_tokens=max(nc.context_buckets), num_speculative_tokens=config.num_speculative_tokens,
            spec_disable_by_batch_size=config.speculative.disable_by_batch_size if config.speculative else None,
            kv_cache_layout=self.runner.kv_layout, policy=config.scheduling_policy,
            whole_prompts=config.pooling is not None and config.pooling.bidirectional,
            max_loras=config.lora.max_loras if config.lora is not None else 0,
            prefill_buckets=tuple(nc.num_batched_tokens_buckets),
            prefill_step_overhead_tokens=overhead,
            split_prompts_at_buckets=overhead is not None and self.runner.prefill_reads_block_tables()),
            kv_transfer=self.kv_transfer.scheduler_side if self.kv_transfer is not None else None,
            kv_tier=KVTierScheduler(self.kv_tier.folder, config.tensor_parallel_size) if self.kv_tier else None)
        if self.scheduler.config.prefill_step_overhead_tokens is not None:
            logger.info("Prefill steps: prompts arriving together share a step only where that lowers the mean time "
                        "to first token%s (prefill is compute-bound on %s)",
                        "; a prompt is split at bucket sizes where that saves padding"
                        if self.scheduler.config.split_prompts_at_buckets else "", self.device.type)
        self.structured = None  # StructuredOutputManager, created with the first grammar request
        self._grammar_wait: dict[str, Request] = {}
        self.async_scheduling = bool(config.async_scheduling)
        self.num_async_sync_fallbacks = 0
        self.num_async_passed = 0  # decode steps fed straight from the previous step's device tokens
        self._queue: deque[tuple[SchedulerOutput, Future]] = deque()
        self._step_failures: dict[str, int] = {}  # request id -> failed steps it was part of
        # Prompt logprobs of requests still prefilling (segmented): their chunks' entries, joined in order.
        self._prompt_logprobs: dict[str, list] = {}
        self._consecutive_step_failures = 0
        # One thread: steps execute in order, so step N+1 always sees step N's KV and runner state.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="vllm-neuron-step") \
            if self.async_scheduling else None
        logger.info("Async scheduling: %s (%s)", f"on, batch queue depth {BATCH_QUEUE_DEPTH}"
                    if self.async_scheduling else "off", config.async_scheduling_reason)
        # The shapes served, for the bucket advisor (engine/served_shapes.py); the profile in progress (its tag).
        self.served = self._served_shapes() if envs.VLLM_NEURON_STEP_TIMING else None
        self._trace_tag: str | None = None
        self.startup_seconds = time.perf_counter() - t0
        if backend == "eager":
            logger.info("Engine ready in %.1f s (eager)", self.startup_seconds)
        else:
            logger.info("Engine ready in %.1f s (%d graphs: %d compiled, %d loaded from the compile cache)",
                        self.startup_seconds, len(self.compiler.records), self.compiler.num_compiled,
                        len(self.compiler.records) - self.compiler.num_compiled)

    def _runner_call(self, name: str, *args):
        """A runner call between steps: tensor-parallel ranks take one call at a time, so with a step in flight
        it waits its turn on the step thread; one rank's runner takes it at once (the calls are thread-safe)."""
        fn = getattr(self.runner, name)
        if self._executor is not None and isinstance(self.runner, TPExecutor):
            return self._executor.submit(fn, *args).result()
        return fn(*args)

    def kv_transfer_tick(self) -> None:
        """An idle instance's transfer work (blocks released by readers, holds timed out)."""
        if self.kv_transfer is not None:
            self.kv_transfer.before_schedule(self.scheduler)

    def tick_ms(self) -> int | None:
        """How soon an idle engine has timed work (None: none)."""
        return self.kv_transfer.tick_ms() if self.kv_transfer is not None else None

    def _served_shapes(self) -> ServedShapes:
        compile_seconds: dict[str, list[float]] = {}
        for name, entry in self.compiler.manifest.items():
            if isinstance(entry, dict) and entry.get("compile_seconds"):
                compile_seconds.setdefault(name.split("_", 1)[0], []).append(float(entry["compile_seconds"]))
        return ServedShapes(None if self.compiler.disabled else self.compiler.dir / SUMMARY_NAME,
                            engine_limits(self.config, self.runner.prefill_needs_context()), engine_lists(self.config),
                            {k: sum(v) / len(v) for k, v in compile_seconds.items()})

    # -- profiling (vllm_neuron/profiler.py) ---------------------------------------------------------------
    def start_profile(self, engine: int = 0, tag: str | None = None) -> None:
        """Starts torch.profiler in this process and on every tensor-parallel rank; ProfilerError when profiling
        is off (VLLM_TORCH_PROFILER_DIR unset) or a profile runs already."""
        profiler.trace_dir()
        if self._trace_tag is not None:
            raise profiler.ProfilerError("a profile is already running: stop it first")
        tag = tag or profiler.new_tag()
        self._runner_call("start_profile", f"engine{engine}", tag)
        self._trace_tag = tag

    def stop_profile(self) -> list[str]:
        """Stops the profile on every rank once each has written its trace; the trace files of every process that
        shares the profile's tag."""
        if self._trace_tag is None:
            raise profiler.ProfilerError("no profile is running: start one first")
        tag, self._trace_tag = self._trace_tag, None
        self._runner_call("stop_profile")
        return profiler.trace_files(tag)

    def shutdown(self) -> None:
        """Lets the other tensor-parallel ranks go and ends the runner's own threads (the KV connector's)."""
        if self.served is not None:
            self.served.flush()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self.runner.close()  # a TPExecutor's: its rank 0's (the others end with their processes)
        if isinstance(self.runner, TPExecutor):
            self.runner.shutdown()

    def add_request(self, req: EngineCoreRequest) -> None:
        # Media hashes join the prefix-cache keys: prompts that differ only in their media share no KV.
        salt = tuple(item.mm_hash for item in req.mm_items) if req.mm_items else ()
        if req.prompt_embeds is not None:  # placeholder ids: the embeddings' bytes key the prefix cache
            salt += (embeds_digest(req.prompt_embeds),)
        if req.lora_request is not None:
            if self.config.lora is None:
                raise ValueError("a LoRA adapter was requested, but LoRA is not enabled (enable_lora=True)")
            salt += req.lora_request.cache_key()  # the same prompt under two adapters shares no KV
        request = Request(req.request_id, req.prompt_token_ids, req.sampling_params, req.eos_token_id,
                          arrival_time=req.arrival_time, cache_salt=salt, mm_items=req.mm_items,
                          priority=req.priority, prompt_embeds=req.prompt_embeds, pooling_params=req.pooling_params,
                          lora_request=req.lora_request)
        if req.sampling_params.structured_outputs is None:
            self.scheduler.add_request(request)
            return
        # The grammar compiles off the step loop; the request waits here until it is ready.
        self._structured().submit(req.request_id, req.sampling_params.structured_outputs)
        self._grammar_wait[req.request_id] = request

    def _structured(self):
        if self.structured is None:
            from vllm_neuron.model.loader import load_tokenizer
            from vllm_neuron.structured_output.manager import StructuredOutputManager

            tok = load_tokenizer(self.config.tokenizer or self.ckpt)
            limits = self.config.grammar_limits
            self.structured = StructuredOutputManager(tok, self.ckpt.hf_config.get_text_config().vocab_size,
                                                      compile_timeout_s=limits.compile_timeout_s,
                                                      cache_bytes=limits.cache_bytes)
        return self.structured

    def abort_requests(self, req_ids: list[str], reason: str = "abort") -> None:
        for rid in req_ids:
            self._grammar_wait.pop(rid, None)
            self._step_failures.pop(rid, None)
            self._prompt_logprobs.pop(rid, None)
            self.scheduler.finish_request(rid, reason)
            if self.structured is not None:
                self.structured.remove(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._grammar_wait) or bool(self._queue)

    def _admit_compiled_grammars(self) -> list[EngineCoreOutput]:
        failed = []
        for rid, request in list(self._grammar_wait.items()):
            ready, error, kind = self.structured.status(rid)
            if error is not None:
                logger.warning("request %s: structured output grammar failed: %s", rid, error)
                del self._grammar_wait[rid]
                self.structured.remove(rid)
                failed.append(EngineCoreOutput(rid, [], finish_reason="error", error=error, error_kind=kind))
            elif ready:
                del self._grammar_wait[rid]
                self.scheduler.add_request(request)
        return failed

    def _wait_for_grammars(self) -> None:
        """With nothing to run but requests whose grammars compile, block a little for one of them: a loop of
        empty steps held a core and the GIL from the compile threads (which run at a lower priority)."""
        if self._grammar_wait:
            self.structured.wait_any(self._grammar_wait, GRAMMAR_IDLE_WAIT_S)

    def step(self) -> EngineCoreOutputs:
        """Runs (or, with async scheduling, advances the pipeline by) one step; returns what finished."""
        failed = self._admit_compiled_grammars() if self._grammar_wait else []
        if not self.async_scheduling:
            sched = self._schedule()
            if sched is None:
                self._wait_for_grammars()
                return EngineCoreOutputs(failed, stats=self._stats(None, None))
            try:
                result = self.runner.execute(sched)
            except WorkerRankError:
                raise  # a rank is gone: no request can be served any more
            except Exception as e:  # noqa: BLE001 - one request's fault must not end the engine
                return self._recover_from_failed_steps([(sched, e)], failed)
            return self._finish(sched, result, failed)
        # Batch queue: schedule step N+1 while step N runs on the executor thread; then wait for N.
        scheduled = False
        if len(self._queue) < BATCH_QUEUE_DEPTH:
            if self._queue and self._grammar_in_flight():
                # The next bitmask needs the in-flight token: finish that step first.
                self.num_async_sync_fallbacks += 1
            else:
                sched = self._schedule()
                if sched is not None:
                    # Under a frame stack chunk of its own (frame_stack.py): one mmap a step, not hundreds.
                    self._queue.append((sched, self._executor.submit(call_with_room, self.runner.execute, sched)))
                    scheduled = True
        if not self._queue:
            self._wait_for_grammars()
            return EngineCoreOutputs(failed, stats=self._stats(None, None))
        if scheduled and len(self._queue) < BATCH_QUEUE_DEPTH:
            return EngineCoreOutputs(failed, stats=self._stats(None, None))
        sched, future = self._queue.popleft()
        try:
            result = future.result()
        except WorkerRankError:
            raise  # a rank is gone: no request can be served any more
        except Exception as e:  # noqa: BLE001 - one request's fault must not end the engine
            return self._recover_from_failed_steps([(sched, e)] + self._drain_queue(), failed)
        return self._finish(sched, result, failed)

    @profiler.ranged("schedule")
    def _schedule(self) -> SchedulerOutput | None:
        if self.kv_transfer is not None:
            self.kv_transfer.before_schedule(self.scheduler)
        if self.kv_tier is not None:
            self.kv_tier.before_schedule(self.scheduler)
        backed = self._backed_blocks()
        if backed is not None:
            self.scheduler.kv.set_backed_blocks(backed)
        sched = self.scheduler.schedule()
        if self.kv_tier is not None:
            self.kv_tier.after_schedule(self.scheduler)
        if sched is None and (self.kv_transfer is not None and self.kv_transfer.busy or
                              self.kv_tier is not None and self.kv_tier.busy(self.scheduler)):
            time.sleep(0.001)  # only reads are in flight: poll them without spinning a core
        if sched is not None and self.structured is not None:
            # A chunk with drafts gets one mask per verified position (the matcher walks its drafts).
            sched.grammar_bitmask = {
                c.req_id: self.structured.bitmasks(c.req_id, c.token_ids[1:], self._tokens_left(c.req_id))
                if c.num_draft_tokens else self.structured.bitmask(c.req_id, self._tokens_left(c.req_id))
                for c in sched.chunks if c.sample and self.structured.has(c.req_id)}
        return sched

    def _tokens_left(self, rid: str) -> int:
        """Tokens the request may still sample, the one now scheduled included (a grammar closes within them)."""
        req = self.scheduler.requests[rid]
        pending = len(req.output_token_ids) + req.num_output_placeholders
        left = self.config.max_model_len - req.num_prompt_tokens - pending
        if req.sampling_params.max_tokens is not None:
            left = min(left, req.sampling_params.max_tokens - pending)
        return left

    def _grammar_in_flight(self) -> bool:
        return self.structured is not None and any(
            self.structured.has(c.req_id) for sched, _ in self._queue for c in sched.chunks)

    # -- a step that raised ------------------------------------------------------------------------
    def _fail(self, rid: str, error: BaseException) -> EngineCoreOutput:
        """Ends one request with `error` (its client gets it); everything else goes on."""
        message = f"{type(error).__name__}: {error}"
        logger.warning("request %s failed: %s", rid, message)
        self.abort_requests([rid])
        return EngineCoreOutput(rid, [], finish_reason="error", error=message)

    def _drain_queue(self) -> list[tuple[SchedulerOutput, BaseException | None]]:
        """Waits for the steps still in flight (they may build on the failed one); their results are dropped."""
        steps: list[tuple[SchedulerOutput, BaseException | None]] = []
        while self._queue:
            sched, future = self._queue.popleft()
            try:
                future.result()
                steps.append((sched, None))
            except Exception as e:  # noqa: BLE001
                steps.append((sched, e))
        return steps

    def _recover_from_failed_steps(self, steps: list[tuple[SchedulerOutput, BaseException | None]],
                                   failed: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """Per-request isolation of a step that raised. The requests a failed step was setting up for
        the first time (sampling state, seed, slot) are the likely cause: one alone fails with the
        error; several are set up again one per step, so that the next failure names the culprit.
        Every other request of the steps is rolled back by preemption and recomputed (its output does
        not change). When no request was new, each of them counts the failure, and one in
        MAX_STEP_FAILURES_PER_REQUEST failed steps fails (a fault that follows a request).
        MAX_CONSECUTIVE_STEP_FAILURES in a row re-raise: an engine fault, not a request's."""
        error = next(e for _, e in steps if e is not None)
        if isinstance(error, WorkerRankError):
            raise error
        self._consecutive_step_failures += 1
        if self._consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise error
        logger.error("A step failed (%s: %s); isolating the requests it held", type(error).__name__, error,
                     exc_info=error)
        new = {d.req_id for sched, e in steps if e is not None for d in sched.new_requests}
        outputs = failed
        for rid in dict.fromkeys(c.req_id for sched, _ in steps for c in sched.chunks):
            req = self.scheduler.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or finished meanwhile
            count = self._step_failures.get(rid, 0) + (not new)
            self._step_failures[rid] = count
            if new == {rid} or count >= MAX_STEP_FAILURES_PER_REQUEST:
                outputs.append(self._fail(rid, error))
            else:
                self.scheduler.preempt(rid, resend_alone=rid in new)
        return EngineCoreOutputs(outputs, stats=self._stats(None, None))

    @profiler.ranged("output")
    def _finish(self, sched: SchedulerOutput, result: ModelRunnerOutput,
                failed: list[EngineCoreOutput]) -> EngineCoreOutputs:
        """Hands one executed step to the scheduler and turns its tokens into outputs."""
        self._consecutive_step_failures = 0
        if self.served is not None and result.bucket_name:
            self._observe(sched, result)
        self.num_async_sync_fallbacks += result.async_fallback
        self.num_async_passed += result.tokens_passed_on_device
        # Requests aborted or preempted while the step ran are not running any more: drop their tokens.
        live = {}
        for c in sched.chunks:
            req = self.scheduler.requests.get(c.req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                live[c.req_id] = req
        outputs = failed
        if sched.grammar_bitmask:
            for rid in sched.grammar_bitmask:
                if rid in live:
                    try:
                        self.structured.accept(rid, result.sampled.get(rid, []))
                    except Exception as e:  # noqa: BLE001 - that request's grammar, not the engine's
                        del live[rid]
                        outputs.append(self._fail(rid, e))
        for rid, (start, entries) in result.prompt_logprobs.items():
            if rid in live:  # a recompute (after a failed step) rewrites the positions it covers
                self._prompt_logprobs.setdefault(rid, [])[start:start + len(entries)] = entries
        finished = {f.request.request_id: f for f in self.scheduler.update(sched, result)}
        if self.kv_transfer is not None:
            self.kv_transfer.after_update()  # prompts held for remote readers are served before their outputs go
        if self.kv_tier is not None:
            self.kv_tier.after_update(self.scheduler)  # new full blocks leave for the tier before reuse
        for rid in finished:
            self._step_failures.pop(rid, None)
            if self.structured is not None:
                self.structured.remove(rid)
        for rid, toks in result.sampled.items():
            req = live.get(rid)
            if req is None:
                continue
            lp = result.logprobs.get(rid)
            fin = finished.get(rid)
            if fin is not None and fin.num_new_tokens is not None:
                toks = toks[:fin.num_new_tokens]  # drafts accepted past a stop token are not output
            outputs.append(EngineCoreOutput(
                rid, list(toks), [lp.entries] if lp is not None else None,
                finish_reason=fin.finish_reason if fin else None,
                stop_reason=req.stop_reason if fin else None, num_cached_tokens=max(req.num_cached_tokens, 0),
                kv_transfer_params=self.kv_transfer.params_of(rid) if fin and self.kv_transfer else None,
                prompt_logprobs=self._prompt_logprobs.pop(rid, None)))  # complete with the first sample
        for rid, data in result.pooled.items():
            req, fin = live.get(rid), finished.get(rid)
            if req is not None and fin is not None:
                outputs.append(EngineCoreOutput(rid, [], finish_reason=fin.finish_reason, pooled=data,
                                                num_cached_tokens=max(req.num_cached_tokens, 0)))
        return EngineCoreOutputs(outputs, self._stats(sched, result))

    def _observe(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> None:
        """One executed step for the bucket advisor's counts, and its DEBUG line (`buckets advise --from-log`
        reads it)."""
        prefill = sched.kind == "prefill"
        size = sched.num_tokens if prefill else len(sched.chunks)
        self.served.record(sched.kind, size, sched.max_seq_len, result.execute_seconds)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("step %s %s=%d/%d context=%d execute_ms=%.3f graph_ms=%.3f", result.bucket_name,
                         "tokens" if prefill else "seqs", size, size + result.num_padding, sched.max_seq_len,
                         result.execute_seconds * 1e3, result.graph_seconds * 1e3)
        self.served.tick(time.monotonic())

    def _backed_blocks(self) -> int | None:
        """How far the runner has backed the KV pool's memory (blocks), for the block pool to stay below it; None
        where it backs nothing ahead (or ranks each back their own, TP)."""
        return None if isinstance(self.runner, TPExecutor) else self.runner.backed_blocks()

    def idle_work(self) -> bool:
        """Runner work that fills idle time (KV pages backed ahead of use); True while some is left. Not with
        tensor parallelism, whose ranks act on broadcast calls only (they back pages before steps). The served
        shapes are written first: an engine stopped by a signal keeps what it served up to its last idle time."""
        if self.served is not None:
            self.served.flush_when_idle(time.monotonic())
        return False if isinstance(self.runner, TPExecutor) else self.runner.idle_work()

    def idle_stats(self) -> SchedulerStats:
        return self._stats(None, None)

    def _stats(self, sched, result) -> SchedulerStats:
        s = self.scheduler
        return SchedulerStats(
            num_running=s.num_running, num_waiting=s.num_waiting, kv_cache_usage=s.kv.usage,
            prefix_queries=s.kv.prefix_queries, prefix_hits=s.kv.prefix_hits, num_preemptions=s.num_preemptions,
            step_kind=sched.kind if sched else "", bucket_name=result.bucket_name if result else "",
            num_padding=result.num_padding if result else 0, num_tokens=sched.num_tokens if sched else 0,
            num_seqs=len(sched.chunks) if sched else 0, context_len=sched.max_seq_len if sched else 0,
            execute_seconds=result.execute_seconds if result else 0.0,
            graph_seconds=result.graph_seconds if result else 0.0,
            num_async_sync_fallbacks=self.num_async_sync_fallbacks, spec_decode=s.spec_stats.cumulative(),
            encoder_cache=self.runner.encoder_cache_stats(),
            grammar_cache_bytes=self.structured.cache_bytes if self.structured is not None else 0,
            grammar_compile_timeouts=self.structured.compile_timeouts if self.structured is not None else 0,
            kv_transfer=self.kv_transfer.stats() if self.kv_transfer is not None else None,
            kv_offload=self.kv_tier.stats(s) if self.kv_tier is not None else None,
            lora=(s.config.max_loras, *s.lora_names()) if s.config.max_loras else None)
