"""The EngineCore process: receives requests over ZMQ, steps the engine, sends outputs back.

One DEALER socket, identity `engine-<dp rank>`, connected to the API server's ROUTER (ipc on one
host, tcp for data-parallel replicas on other hosts). Messages are pickled tuples ("add",
EngineCoreRequest) / ("abort", [ids]) / ("profile", "start" | "stop", tag, engine) / ("shutdown",) in, and ("hello",
info) / ("progress", {done, total, last}) per warm-up graph / ("ready", info) / ("outputs", EngineCoreOutputs) /
("alive", None) / ("profiled", error or None) / ("dead", message) out. The loop blocks on the socket only when no
request is unfinished, so an idle engine costs nothing.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import time
import traceback
from typing import Any

import zmq

from vllm_neuron import heap
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.engine.replica import ReplicaPlacement, apply_placement, engine_identity
from vllm_neuron.frame_stack import call_with_room
from vllm_neuron.logger import init_logger
from vllm_neuron.proc_lifecycle import before_exit, install_stack_dumps

logger = init_logger(__name__)

# A busy engine sends something at least this often (the client's hang detection: VLLM_ENGINE_ITERATION_TIMEOUT_S).
ALIVE_S = 1.0
# Idle work (backing KV pages ahead) starts only after this long without a request or a step. Work in every
# short gap kept both cores busy while the API server and its clients needed them between request waves:
# P3's warm TTFT (4 requests in flight, waves back to back) was 119-153 ms with it, 70-86 ms without
# (Zen 5 EPYC VM, 2026-12-04).
IDLE_WORK_AFTER_S = 0.25
# glibc keeps freed memory in its per-thread heaps (grammar compile threads, large requests): given back when
# the engine turns idle (at most every 5 s) and once a minute under constant load (vllm_neuron/heap.py).
IDLE_TRIM_EVERY_S = 5.0
BUSY_TRIM_EVERY_S = 60.0


def _send(sock: zmq.Socket, msg: Any) -> None:
    sock.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), copy=False)


def spawn_replica(config: EngineConfig, address: str, placement: ReplicaPlacement,
                  model_name: str) -> multiprocessing.Process:
    """Starts one EngineCore process that connects to `address` (the head's ROUTER socket)."""
    proc = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, args=(config, address, placement, model_name),
        name=f"EngineCore_DP{placement.rank}", daemon=True)
    proc.start()
    return proc


def run_engine_core(config: EngineConfig, address: str, placement: ReplicaPlacement, model_name: str) -> None:
    """Process entry point (spawned)."""
    install_stack_dumps()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server process owns Ctrl-C and tells us
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, engine_identity(placement.rank))
    sock.connect(address)
    inp = out = sock
    try:
        from vllm_neuron import metrics
        from vllm_neuron.engine.core import EngineCore

        _send(out, ("hello", {"pid": os.getpid(), "host": socket.gethostname()}))
        apply_placement(placement)  # the config came resolved, its KV-budget share included
        metrics.configure(model_name, engine=placement.rank)
        core = EngineCore(config, on_progress=lambda done, total, how: _send(
            out, ("progress", {"done": done, "total": total, "last": how})))
        for rec in core.compiler.records:
            metrics.record_compilation_time(rec.name, rec.seconds)
        metrics.record_model_load(core.load_stats.seconds, core.load_stats.nbytes)
        if core.served is not None:
            from vllm_neuron import step_metrics

            step_metrics.record_bucket_graphs([g.name for g in core.runner.graph_names()])
        import torch

        _send(out, ("ready", {"pid": os.getpid(), "startup_seconds": core.startup_seconds,
                              "num_blocks": core.num_blocks, "threads": torch.get_num_threads()}))
        # Under a frame stack chunk of its own: no step maps and unmaps frame memory (frame_stack.py).
        call_with_room(_loop, core, inp, out, metrics, log_stats=not config.disable_log_stats)
        core.shutdown()
    except Exception as e:  # noqa: BLE001 - the client must learn why the engine died
        logger.error("EngineCore died: %s\n%s", e, traceback.format_exc())
        _send(out, ("dead", f"{type(e).__name__}: {e}"))
    finally:
        sock.close(linger=1000)
        ctx.term()
        before_exit()


def _loop(core, inp: zmq.Socket, out: zmq.Socket, metrics, log_stats: bool = True) -> None:
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    recorder = _StatsRecorder(metrics)
    from vllm_neuron import envs
    from vllm_neuron.engine.stats_logger import StatsLogger

    stats_logger = StatsLogger(envs.VLLM_LOG_STATS_INTERVAL, time.monotonic()) if log_stats else None
    last_sent = time.monotonic()
    idle_work = True  # idle time may have work to fill: poll without blocking until it says it has none
    last_busy = last_trim = time.monotonic()
    while True:
        busy = core.has_unfinished()  # the stats line's wait only matters to an idle engine
        timeout = poll_timeout_ms(busy, idle_work, time.monotonic() - last_busy,
                                  None if busy else _idle_timeout_ms(stats_logger))
        tick = None if busy else core.tick_ms()  # blocks held for remote readers: their releases and timeouts
        if tick is not None:
            timeout = tick if timeout is None else min(timeout, tick)
        handled = False
        while poller.poll(timeout):
            msg = pickle.loads(inp.recv())
            if msg[0] == "shutdown":
                return
            _handle(core, out, msg)
            handled, timeout = True, 0
        now = time.monotonic()
        if stats_logger is not None:
            stats_logger.maybe_log(now)
        if handled:
            last_busy = now
        if not core.has_unfinished():
            if tick is not None:
                core.kv_transfer_tick()
            if handled or tick is not None:  # aborts and releases free blocks: the gauges must say so
                recorder.record(core.idle_stats())
            if idle_work and now - last_busy >= IDLE_WORK_AFTER_S:
                if now - last_trim >= IDLE_TRIM_EVERY_S:
                    heap.trim()
                    last_trim = now
                idle_work = core.idle_work()
            continue
        outs = core.step()
        last_busy = time.monotonic()
        if last_busy - last_trim >= BUSY_TRIM_EVERY_S:
            heap.trim()
            last_trim = last_busy
        idle_work = True  # the step may have moved the newest block: idle time may have work again
        recorder.record(outs.stats)
        if stats_logger is not None:
            stats_logger.record(outs)
        now = time.monotonic()
        if outs.outputs:
            _send(out, ("outputs", outs))
            last_sent = now
        elif now - last_sent > ALIVE_S:  # steps without tokens (long prompts' segments) still show progress
            _send(out, ("alive", None))
            last_sent = now


def poll_timeout_ms(has_work: bool, idle_work: bool, since_busy_s: float, log_timeout_ms: int | None) -> int | None:
    """How long the loop may block on its input (pure): not at all while requests run; until idle work is due
    (IDLE_WORK_AFTER_S after the last request or step), not at all once it is; else until the stats line
    (None: until a message)."""
    if has_work:
        return 0
    if idle_work:
        due_ms = max(0, int((IDLE_WORK_AFTER_S - since_busy_s) * 1000 + 0.999))
        return due_ms if log_timeout_ms is None else min(due_ms, log_timeout_ms)
    return log_timeout_ms


def _idle_timeout_ms(stats_logger) -> int | None:
    """An idle engine blocks on its input, waking once more only to log the interval that saw work."""
    if stats_logger is None or not (stats_logger.generation_tokens or stats_logger.prompt_tokens
                                    or any(stats_logger.last_throughput)):
        return None
    return int(stats_logger.seconds_to_next(time.monotonic()) * 1000) + 1


def _handle(core, out: zmq.Socket, msg: tuple) -> None:
    if msg[0] == "add":
        try:
            core.add_request(msg[1])
        except Exception as e:  # noqa: BLE001 - a duplicate id or any setup error fails that request only
            from vllm_neuron.engine.messages import EngineCoreOutput, EngineCoreOutputs

            logger.warning("request %s rejected: %s", msg[1].request_id, e, exc_info=not isinstance(e, ValueError))
            _send(out, ("outputs", EngineCoreOutputs([EngineCoreOutput(
                msg[1].request_id, [], finish_reason="error", error=f"{type(e).__name__}: {e}")])))
    elif msg[0] == "abort":
        core.abort_requests(msg[1], msg[2] if len(msg) > 2 else "abort")
    elif msg[0] == "profile":  # ("profile", "start" | "stop", tag, engine index): answered ("profiled", error)
        _, action, tag, engine = msg
        try:
            if action == "start":
                core.start_profile(engine, tag)
            else:
                core.stop_profile()
            error = None
        except Exception as e:  # noqa: BLE001 - the client reports it; the engine goes on
            logger.warning("profile %s: %s", action, e)
            error = f"{type(e).__name__}: {e}"
        _send(out, ("profiled", error))


class _StatsRecorder:
    """Turns the scheduler's cumulative counters into the per-step increments metrics expects."""

    def __init__(self, metrics) -> None:
        self.metrics = metrics
        self.prev = (0, 0, 0, 0)
        self.prev_spec = (0, 0, 0, [])
        self.prev_encoder = (0, 0, 0)
        self.prev_grammar = (-1, 0)  # (cache bytes, compile timeouts) last recorded
        self.prev_kv = (0, 0, 0, 0)  # (expired, blocks read, recomputed, bytes read) last recorded
        self.prev_offload = (0, 0, 0, 0)  # second tier: (blocks read, written, failed reads, bytes read)
        from vllm_neuron import envs, step_metrics

        self.steps = step_metrics if envs.VLLM_NEURON_STEP_TIMING else None  # the per-step series

    def record(self, s) -> None:
        if s is None:
            return
        cur = (s.prefix_queries, s.prefix_hits, s.num_preemptions, s.num_async_sync_fallbacks)
        self.metrics.record_step(num_running=s.num_running, num_waiting=s.num_waiting,
                                 kv_cache_usage=s.kv_cache_usage, prefix_cache_queries=cur[0] - self.prev[0],
                                 prefix_cache_hits=cur[1] - self.prev[1], num_preemptions=cur[2] - self.prev[2])
        for _ in range(cur[3] - self.prev[3]):
            self.metrics.record_async_sync_fallback()
        self.prev = cur
        if s.spec_decode is not None:
            d, t, a, per_pos = s.spec_decode
            pd, pt, pa, prev_pos = self.prev_spec
            self.metrics.record_spec_decode(d - pd, t - pt, a - pa,
                                            [n - (prev_pos[i] if i < len(prev_pos) else 0) for i, n in enumerate(per_pos)])
            self.prev_spec = s.spec_decode
        if s.encoder_cache is not None:
            self.metrics.record_encoder_cache(*(n - p for n, p in zip(s.encoder_cache, self.prev_encoder)))
            self.prev_encoder = s.encoder_cache
        grammar = (s.grammar_cache_bytes, s.grammar_compile_timeouts)
        if grammar != self.prev_grammar:
            self.metrics.record_grammar_cache(self.metrics.engine_process(), grammar[0])
            if grammar[1] > self.prev_grammar[1]:
                self.metrics.record_grammar_timeout(self.metrics.engine_process(), grammar[1] - self.prev_grammar[1])
            self.prev_grammar = grammar
        if s.kv_transfer is not None:
            held_reqs, held_blocks, expired, _, blocks, recomputed, nbytes, results = s.kv_transfer
            cur = (expired, blocks, recomputed, nbytes)
            self.metrics.record_kv_transfer(held_requests=held_reqs, held_blocks=held_blocks,
                                            **dict(zip(("expired", "blocks", "recomputed", "nbytes"),
                                                       (c - p for c, p in zip(cur, self.prev_kv)))),
                                            seconds=[t for ok, _, t in results if ok])
            self.prev_kv = cur
        if s.kv_offload is not None:
            _, loaded, failed, stored, nbytes, seconds = s.kv_offload
            cur = (loaded, stored, failed, nbytes)
            self.metrics.record_kv_offload(**dict(zip(("loaded", "stored", "failed", "nbytes"),
                                                      (c - p for c, p in zip(cur, self.prev_offload)))),
                                           seconds=seconds)
            self.prev_offload = cur
        if s.lora is not None:
            self.metrics.record_lora(*s.lora)
        if s.bucket_name:
            self.metrics.record_execution(s.bucket_name)
            self.metrics.record_padding("tokens" if s.step_kind == "prefill" else "seqs", s.bucket_name,
                                        s.num_padding)
            if self.steps is not None:
                real = s.num_tokens if s.step_kind == "prefill" else s.num_seqs
                self.steps.record_step_timing(s.bucket_name, s.execute_seconds, s.graph_seconds,
                                              real / max(real + s.num_padding, 1))
                self.steps.record_served_shape("prefill" if s.step_kind == "prefill" else "decode", real,
                                               s.context_len)
