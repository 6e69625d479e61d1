"""Prometheus metrics: vLLM's `vllm:*` series and the seeds' `vllm_neuron:*` series.

prometheus_client runs in multiprocess mode: every process (API server, EngineCore, workers)
writes its samples to mmap files under PROMETHEUS_MULTIPROC_DIR and the API server's /metrics
handler (`metrics_response_body`) aggregates them with MultiProcessCollector. The folder is
created here, at import, when the variable is unset; child processes inherit it through the
environment. Wipe it between server restarts (a fresh temporary folder is used when unset).

Callers pass plain numbers and strings only; nothing here knows about requests or tensors.
Call `configure(model_name, rank_id, engine)` once per process before recording: it fixes the labels.
The series the engine records carry an `engine` label (vLLM's: the data-parallel replica's rank), so
/metrics shows each replica's queues, KV usage, prefix-cache hits and graph executions apart.

Who records what (exactly one owner per series, or counts double):

    engine (scheduler side, once per step)      record_step(...)
        vllm:num_requests_running / num_requests_waiting / kv_cache_usage_perc (gauges)
        vllm:prefix_cache_queries / prefix_cache_hits / num_preemptions (counters)
                                                record_spec_decode(...) with speculative decoding
        vllm:spec_decode_num_drafts / num_draft_tokens / num_accepted_tokens /
        num_accepted_tokens_per_pos{position} (counters)
    engine (model runner, driver rank, per step) record_padding(...), record_execution(...),
                                                 record_async_sync_fallback(); step_metrics.py's record_*
    workers (each rank, at start-up)            record_compilation_time(...), record_model_load(...)
    server launcher (once, when ready)          record_startup_time(...)
    API server and engines (their own process)  record_grammar_cache(...), record_grammar_timeout(...)
        vllm_neuron:grammar_cache_bytes{process} (gauge), vllm_neuron:grammar_compile_timeouts{process}
    API server (admission, per request)         record_admission(...)
        vllm_neuron:num_requests_admitted (gauge), vllm_neuron:num_requests_rejected{reason} (counter)
    API server (per request, from the stream it serves; see RequestTimer)
        vllm:prompt_tokens / generation_tokens / request_success (counters)
        vllm:time_to_first_token_seconds / inter_token_latency_seconds /
        e2e_request_latency_seconds / request_prompt_tokens / request_generation_tokens
    The engine must NOT record the per-request series: the HTTP layer sees every token because
    it asks the engine for DELTA outputs, and records them through RequestTimer.
"""
from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Literal

from vllm_neuron import envs
from vllm_neuron.logger import init_logger, warning_once

logger = init_logger(__name__)



def _remove_at_exit(path: str) -> None:
    """Removes `path` when this process exits: at exit, and on SIGTERM / SIGHUP too, whose default action
    skips atexit (a test run or a loading server killed by them left the folder behind). A signal handler
    already installed is left alone; ours removes the folder, then lets the signal take its default course."""
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    owner = os.getpid()

    def remove_then_die(signum: int, _frame: object) -> None:
        if os.getpid() == owner:  # not in a forked child, which shares the handler but not the folder
            shutil.rmtree(path, ignore_errors=True)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    for name in ("SIGTERM", "SIGHUP"):  # no SIGHUP on Windows
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, remove_then_die)


# prometheus_client picks its value class (mmap-backed or in-memory) from this variable when it
# is imported, so the folder must exist in the environment first.
if envs.PROMETHEUS_MULTIPROC_DIR is None:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="vllm_neuron_prometheus_")
    # Ours to remove: the process that made it exits last (child processes inherit the variable).
    _remove_at_exit(os.environ["PROMETHEUS_MULTIPROC_DIR"])
MULTIPROC_DIR: str = os.environ["PROMETHEUS_MULTIPROC_DIR"]
os.makedirs(MULTIPROC_DIR, exist_ok=True)

import prometheus_client  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, values  # noqa: E402

# If something imported prometheus_client before the variable was set, its value class is the
# in-memory one; metrics created below must write to the shared files instead.
values.ValueClass = values.get_value_class()

CONTENT_TYPE: str = prometheus_client.CONTENT_TYPE_LATEST

# Bucket boundaries are vLLM's, so dashboards built for vLLM read ours unchanged.
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_TOKEN_COUNT_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                        50000, 100000, 200000]
_SEQS_PADDING_BUCKETS = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256]
_TOKENS_PADDING_BUCKETS = [0] + [2 ** i for i in range(0, 17)]

_M = ["model_name"]
# Series the engine records carry vLLM's `engine` label: the data-parallel rank of the replica.
_ME = ["model_name", "engine"]
_MB = ["model_name", "engine", "bucket_name"]
_MBR = ["model_name", "engine", "bucket_name", "rank_id"]
_MR = ["model_name", "engine", "rank_id"]

# registry=None: the series live only in the multiprocess files; /metrics builds a fresh registry
# from them, so nothing is exposed twice and a second import cannot collide.
# Gauges: "livesum" adds the values of live processes (one per DP replica); "livemax" keeps the
# fullest pool; start-up gauges are set once per process, so "max" survives that process' exit.
NUM_REQUESTS_RUNNING = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                             _ME, registry=None, multiprocess_mode="livesum")
NUM_REQUESTS_WAITING = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                             _ME, registry=None, multiprocess_mode="livesum")
# vLLM's LoRA info series: the label set names the adapters of running and waiting requests, the value is when
# that was last true (a new label set per change, as vLLM exports it).
LORA_REQUESTS_INFO = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                           ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=None,
                           multiprocess_mode="livemostrecent")
KV_CACHE_USAGE = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                       _ME, registry=None, multiprocess_mode="livemax")
PREFIX_CACHE_QUERIES = Counter("vllm:prefix_cache_queries",
                               "Prefix cache queries, in terms of number of queried tokens.", _ME, registry=None)
PREFIX_CACHE_HITS = Counter("vllm:prefix_cache_hits",
                            "Prefix cache hits, in terms of number of cached tokens.", _ME, registry=None)
NUM_PREEMPTIONS = Counter("vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
                          _ME, registry=None)
PROMPT_TOKENS = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", _M, registry=None)
GENERATION_TOKENS = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            _M, registry=None)
REQUEST_SUCCESS = Counter("vllm:request_success", "Count of successfully processed requests.",
                          ["model_name", "finished_reason"], registry=None)
TIME_TO_FIRST_TOKEN = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                _M, registry=None, buckets=_TTFT_BUCKETS)
INTER_TOKEN_LATENCY = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                                _M, registry=None, buckets=_ITL_BUCKETS)
E2E_REQUEST_LATENCY = Histogram("vllm:e2e_request_latency_seconds",
                                "Histogram of e2e request latency in seconds.", _M, registry=None,
                                buckets=_E2E_BUCKETS)
REQUEST_PROMPT_TOKENS = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                  _M, registry=None, buckets=_TOKEN_COUNT_BUCKETS)
REQUEST_GENERATION_TOKENS = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                      _M, registry=None, buckets=_TOKEN_COUNT_BUCKETS)

NUM_SEQS_PADDING = Histogram("vllm_neuron:num_seqs_padding", "Padded batch lines per model execution.",
                             _MB, registry=None, buckets=_SEQS_PADDING_BUCKETS)
NUM_BATCHED_TOKENS_PADDING = Histogram("vllm_neuron:num_batched_tokens_padding",
                                       "Padded token positions per model execution.", _MB, registry=None,
                                       buckets=_TOKENS_PADDING_BUCKETS)
NEFF_EXECUTION_COUNT = Counter("vllm_neuron:neff_execution_count", "Compiled-graph executions, by bucket.",
                               _MB, registry=None)
ASYNC_SYNC_FALLBACKS = Counter("vllm_neuron:async_sync_fallbacks",
                               "Steps where async scheduling fell back to a synchronous step.", _ME, registry=None)
STARTUP_TIME = Gauge("vllm_neuron:startup_time_seconds", "Total server startup time.", _M, registry=None,
                     multiprocess_mode="max")
COMPILATION_TIME = Gauge("vllm_neuron:compilation_time_seconds", "Graph compilation time, by bucket.",
                         _MBR, registry=None, multiprocess_mode="max")
MODEL_LOAD_TIME = Gauge("vllm_neuron:model_load_time_seconds", "Weight load time (host to device).",
                        _MR, registry=None, multiprocess_mode="max")
MODEL_LOAD_SIZE = Gauge("vllm_neuron:model_load_size_bytes", "Weight size transferred to device.",
                        _MR, registry=None, multiprocess_mode="max")

SPEC_DECODE_NUM_DRAFTS = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", _ME,
                                 registry=None)
SPEC_DECODE_NUM_DRAFT_TOKENS = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", _ME,
                                       registry=None)
SPEC_DECODE_NUM_ACCEPTED_TOKENS = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                          _ME, registry=None)
SPEC_DECODE_ACCEPTED_PER_POS = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                       "Accepted tokens per draft position.", _ME + ["position"], registry=None)
ENCODER_CACHE_HITS = Counter("vllm_neuron:encoder_cache_hits", "Media items whose vision embeddings came from the "
                             "encoder cache.", _ME, registry=None)
ENCODER_CACHE_MISSES = Counter("vllm_neuron:encoder_cache_misses", "Media items the vision encoder ran for.", _ME,
                               registry=None)
ENCODER_CACHE_EVICTIONS = Counter("vllm_neuron:encoder_cache_evictions", "Media items freed from the encoder cache "
                                  "to make room (never one within its hold time).", _ME, registry=None)
# `process`: "api_server" (its grammar compile process) or "engine_<rank>".
GRAMMAR_CACHE_BYTES = Gauge("vllm_neuron:grammar_cache_bytes", "Bytes of compiled grammars kept for reuse "
                            "(--grammar-cache-bytes), by process.", ["model_name", "process"], registry=None,
                            multiprocess_mode="livesum")
GRAMMAR_COMPILE_TIMEOUTS = Counter("vllm_neuron:grammar_compile_timeouts", "Grammars refused for compiling longer "
                                   "than --grammar-compile-timeout, by process.", ["model_name", "process"],
                                   registry=None)
NUM_REQUESTS_ADMITTED = Gauge("vllm_neuron:num_requests_admitted", "Engine requests the API server admitted and "
                              "has not finished (running or waiting; --max-num-queued-reqs bounds them).", _M,
                              registry=None, multiprocess_mode="livesum")
NUM_REQUESTS_REJECTED = Counter("vllm_neuron:num_requests_rejected", "Requests answered 503 because the server "
                                "was saturated, by reason.", ["model_name", "reason"], registry=None)
# Disaggregated prefill/decode (only with --kv-transfer-config).
KV_TRANSFER_BLOCKS = Counter("vllm_neuron:kv_transfer_blocks", "KV blocks read from prefill instances.", _ME,
                             registry=None)
KV_TRANSFER_BYTES = Counter("vllm_neuron:kv_transfer_bytes", "Bytes of KV read from prefill instances (this "
                            "instance's first tensor-parallel rank).", _ME, registry=None)
KV_TRANSFER_TIME = Histogram("vllm_neuron:kv_transfer_time_seconds", "Time to read one request's KV blocks from "
                             "its prefill instance.", _ME, registry=None,
                             buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0])
KV_TRANSFER_RECOMPUTED = Counter("vllm_neuron:kv_transfer_recomputed", "Requests prefilled here because their KV "
                                 "could not be read from the prefill instance.", _ME, registry=None)
KV_HELD_BLOCKS = Gauge("vllm_neuron:kv_transfer_held_blocks", "KV blocks a prefill instance holds for decode "
                       "instances to read.", _ME, registry=None, multiprocess_mode="livesum")
KV_HELD_REQUESTS = Gauge("vllm_neuron:kv_transfer_held_requests", "Finished prefills whose KV blocks are held for "
                         "a decode instance.", _ME, registry=None, multiprocess_mode="livesum")
KV_HOLD_EXPIRED = Counter("vllm_neuron:kv_transfer_hold_expired", "Held KV blocks freed because no decode "
                          "instance read them within hold_timeout_s, in requests.", _ME, registry=None)
KV_OFFLOAD_LOADED = Counter("vllm_neuron:kv_offload_loaded_blocks", "KV blocks read back from the second tier "
                            "instead of prefilled (--kv-offloading-size).", _ME, registry=None)
KV_OFFLOAD_STORED = Counter("vllm_neuron:kv_offload_stored_blocks", "KV blocks written to the second tier.", _ME,
                            registry=None)
KV_OFFLOAD_READ_BYTES = Counter("vllm_neuron:kv_offload_read_bytes", "Bytes read back from the second tier (the "
                                "first tensor-parallel rank's files).", _ME, registry=None)
KV_OFFLOAD_FAILED = Counter("vllm_neuron:kv_offload_failed_loads", "Reads from the second tier that failed (a torn, "
                            "foreign or unreadable file): those blocks were prefilled instead.", _ME, registry=None)
KV_OFFLOAD_TIME = Histogram("vllm_neuron:kv_offload_load_time_seconds", "Time to read one request's blocks back "
                            "from the second tier.", _ME, registry=None,
                            buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0])
KV_TRANSFER_SERIES: tuple[str, ...] = (
    "vllm_neuron:kv_transfer_blocks_total", "vllm_neuron:kv_transfer_bytes_total",
    "vllm_neuron:kv_transfer_time_seconds", "vllm_neuron:kv_transfer_recomputed_total",
    "vllm_neuron:kv_transfer_held_blocks", "vllm_neuron:kv_transfer_held_requests",
    "vllm_neuron:kv_transfer_hold_expired_total")
# Only with a multimodal model.
ENCODER_CACHE_SERIES: tuple[str, ...] = ("vllm_neuron:encoder_cache_hits_total",
                                         "vllm_neuron:encoder_cache_misses_total",
                                         "vllm_neuron:encoder_cache_evictions_total")
# Only with --speculative-config (as in vLLM).
SPEC_DECODE_SERIES: tuple[str, ...] = (
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
)

# Every series name as exposed (counters gain _total), for docs and tests.
SERIES_NAMES: tuple[str, ...] = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
    "vllm_neuron:num_seqs_padding", "vllm_neuron:num_batched_tokens_padding",
    "vllm_neuron:neff_execution_count_total", "vllm_neuron:async_sync_fallbacks_total",
    "vllm_neuron:startup_time_seconds", "vllm_neuron:compilation_time_seconds",
    "vllm_neuron:model_load_time_seconds", "vllm_neuron:model_load_size_bytes",
    "vllm_neuron:grammar_cache_bytes", "vllm_neuron:grammar_compile_timeouts_total",
    "vllm_neuron:num_requests_admitted", "vllm_neuron:num_requests_rejected_total",
)

REJECT_REASONS = ("queue_full", "grammar_busy")

_lock = threading.Lock()
_model_name: str | None = None
_rank_id: str = "0"
_engine: str = "0"


def configure(model_name: str, rank_id: int = 0, engine: int = 0, *, api_server: bool = False) -> None:
    """Sets this process' `model_name` label (the served model name), `rank_id` (local rank) and
    `engine` (the data-parallel rank of the engine replica it belongs to); `api_server`: this process
    serves HTTP (its own series are created too).

    Also creates the label sets that are known up front, so that /metrics lists the vLLM series
    with a 0 value before the first request (dashboards and scrapers expect them).
    """
    global _model_name, _rank_id, _engine
    if not isinstance(model_name, str) or not model_name:
        raise ValueError(f"model_name must be a non-empty string, got {model_name!r}")
    for name, value in (("rank_id", rank_id), ("engine", engine)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    with _lock:
        _model_name = model_name
        _rank_id = str(rank_id)
        _engine = str(engine)
    for metric in (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE, PREFIX_CACHE_QUERIES,
                   PREFIX_CACHE_HITS, NUM_PREEMPTIONS, ASYNC_SYNC_FALLBACKS):
        metric.labels(model_name, _engine)
    for metric in (PROMPT_TOKENS, GENERATION_TOKENS, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, E2E_REQUEST_LATENCY,
                   REQUEST_PROMPT_TOKENS, REQUEST_GENERATION_TOKENS):
        metric.labels(model_name)
    for reason in ("stop", "length", "abort", "error"):
        REQUEST_SUCCESS.labels(model_name, reason)
    process = "api_server" if api_server else engine_process()
    GRAMMAR_CACHE_BYTES.labels(model_name, process)
    GRAMMAR_COMPILE_TIMEOUTS.labels(model_name, process)
    if api_server:
        NUM_REQUESTS_ADMITTED.labels(model_name)
        for reason in REJECT_REASONS:
            NUM_REQUESTS_REJECTED.labels(model_name, reason)


def _name() -> str:
    if _model_name is None:
        warning_once(logger, "metrics recorded before vllm_neuron.metrics.configure(); "
                             "model_name label is 'unknown'")
        return "unknown"
    return _model_name


# ---- engine side -------------------------------------------------------------------------------

def record_step(*, num_running: int, num_waiting: int, kv_cache_usage: float,
                prefix_cache_queries: int = 0, prefix_cache_hits: int = 0,
                num_preemptions: int = 0) -> None:
    """Once per engine step, by the scheduler: queue sizes, KV usage (fraction in [0, 1]) and the
    step's increments of prefix-cache queried/hit tokens and preemptions."""
    me = _name(), _engine
    NUM_REQUESTS_RUNNING.labels(*me).set(num_running)
    NUM_REQUESTS_WAITING.labels(*me).set(num_waiting)
    KV_CACHE_USAGE.labels(*me).set(kv_cache_usage)
    if prefix_cache_queries:
        PREFIX_CACHE_QUERIES.labels(*me).inc(prefix_cache_queries)
    if prefix_cache_hits:
        PREFIX_CACHE_HITS.labels(*me).inc(prefix_cache_hits)
    if num_preemptions:
        NUM_PREEMPTIONS.labels(*me).inc(num_preemptions)


def record_lora(max_loras: int, running: list[str], waiting: list[str]) -> None:
    """The adapters of running and waiting requests (names), once per engine step with LoRA on."""
    LORA_REQUESTS_INFO.labels(str(max_loras), ",".join(waiting), ",".join(running)).set_to_current_time()


def record_spec_decode(num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                       accepted_per_pos: list[int]) -> None:
    """One step's increments of the speculative-decoding counters (accepted_per_pos[i]: drafts accepted
    at position i). Called every step when speculation is on, so the series exist from the start."""
    me = _name(), _engine
    SPEC_DECODE_NUM_DRAFTS.labels(*me).inc(num_drafts)
    SPEC_DECODE_NUM_DRAFT_TOKENS.labels(*me).inc(num_draft_tokens)
    SPEC_DECODE_NUM_ACCEPTED_TOKENS.labels(*me).inc(num_accepted_tokens)
    for pos, n in enumerate(accepted_per_pos):
        SPEC_DECODE_ACCEPTED_PER_POS.labels(*me, str(pos)).inc(n)


def record_encoder_cache(hits: int, misses: int, evictions: int) -> None:
    """One step's increments of the encoder cache's hits, misses and evictions (media items). Called every
    step with a multimodal model, so the series exist from the start."""
    me = _name(), _engine
    ENCODER_CACHE_HITS.labels(*me).inc(hits)
    ENCODER_CACHE_MISSES.labels(*me).inc(misses)
    ENCODER_CACHE_EVICTIONS.labels(*me).inc(evictions)


def record_kv_transfer(*, held_requests: int, held_blocks: int, expired: int, blocks: int, nbytes: int,
                       recomputed: int, seconds: list[float]) -> None:
    """One step's disaggregation increments (held_*: levels). Called every step of a disaggregated instance."""
    me = _name(), _engine
    KV_HELD_REQUESTS.labels(*me).set(held_requests)
    KV_HELD_BLOCKS.labels(*me).set(held_blocks)
    KV_HOLD_EXPIRED.labels(*me).inc(expired)
    KV_TRANSFER_BLOCKS.labels(*me).inc(blocks)
    KV_TRANSFER_BYTES.labels(*me).inc(nbytes)
    KV_TRANSFER_RECOMPUTED.labels(*me).inc(recomputed)
    for t in seconds:
        KV_TRANSFER_TIME.labels(*me).observe(t)


def record_kv_offload(*, loaded: int, stored: int, failed: int, nbytes: int, seconds: list[float]) -> None:
    """One step's second-tier increments."""
    me = _name(), _engine
    KV_OFFLOAD_LOADED.labels(*me).inc(loaded)
    KV_OFFLOAD_STORED.labels(*me).inc(stored)
    KV_OFFLOAD_FAILED.labels(*me).inc(failed)
    KV_OFFLOAD_READ_BYTES.labels(*me).inc(nbytes)
    for t in seconds:
        KV_OFFLOAD_TIME.labels(*me).observe(t)


def record_padding(kind: Literal["seqs", "tokens"], bucket_name: str, padding: int) -> None:
    """Padding of one model execution in bucket `bucket_name` (e.g. "decode_b8"): "seqs" counts
    padded batch lines, "tokens" padded token positions. Driver rank only."""
    if kind == "seqs":
        NUM_SEQS_PADDING.labels(_name(), _engine, bucket_name).observe(padding)
    elif kind == "tokens":
        NUM_BATCHED_TOKENS_PADDING.labels(_name(), _engine, bucket_name).observe(padding)
    else:
        raise ValueError(f"kind must be one of 'seqs', 'tokens'; got {kind!r}")


def record_execution(bucket_name: str, count: int = 1) -> None:
    """`count` executions of the compiled graph of `bucket_name`. Driver rank only."""
    NEFF_EXECUTION_COUNT.labels(_name(), _engine, bucket_name).inc(count)


def record_async_sync_fallback() -> None:
    """One step where async scheduling fell back to a synchronous step (batch changed)."""
    ASYNC_SYNC_FALLBACKS.labels(_name(), _engine).inc()


def record_compilation_time(bucket_name: str, seconds: float) -> None:
    """Compile (or cache load) time of one bucket's graph, on this rank."""
    COMPILATION_TIME.labels(_name(), _engine, bucket_name, _rank_id).set(seconds)


def record_model_load(seconds: float, size_bytes: int) -> None:
    """Weight load time and bytes moved to the device, on this rank."""
    MODEL_LOAD_TIME.labels(_name(), _engine, _rank_id).set(seconds)
    MODEL_LOAD_SIZE.labels(_name(), _engine, _rank_id).set(size_bytes)


def record_startup_time(seconds: float) -> None:
    """Total start-up time, from process start until the server reports ready."""
    STARTUP_TIME.labels(_name()).set(seconds)


def record_grammar_cache(process: str, nbytes: int) -> None:
    """The size of `process`'s compiled-grammar cache ("api_server", or engine_process())."""
    GRAMMAR_CACHE_BYTES.labels(_name(), process).set(nbytes)


def record_grammar_timeout(process: str, count: int = 1) -> None:
    """`count` grammars refused in `process` for compiling past --grammar-compile-timeout."""
    GRAMMAR_COMPILE_TIMEOUTS.labels(_name(), process).inc(count)


def engine_labels() -> tuple[str, str]:
    """(model_name, engine): the labels every engine-side series starts with."""
    return _name(), _engine


def engine_process() -> str:
    """This engine process' `process` label."""
    return f"engine_{_engine}"


# ---- API server side ---------------------------------------------------------------------------

def record_admission(admitted: int, rejected_reason: str | None = None) -> None:
    """Engine requests admitted and unfinished now; `rejected_reason` (one of REJECT_REASONS): one request
    was just answered 503."""
    name = _name()
    NUM_REQUESTS_ADMITTED.labels(name).set(admitted)
    if rejected_reason is not None:
        NUM_REQUESTS_REJECTED.labels(name, rejected_reason).inc()


def record_first_token(ttft_s: float, prompt_tokens: int) -> None:
    name = _name()
    TIME_TO_FIRST_TOKEN.labels(name).observe(ttft_s)
    PROMPT_TOKENS.labels(name).inc(prompt_tokens)


def record_new_tokens(num_tokens: int, itl_s: float | None) -> None:
    """`num_tokens` generated tokens that arrived together; `itl_s` the time since the previous
    arrival (None for the first one)."""
    name = _name()
    if num_tokens:
        GENERATION_TOKENS.labels(name).inc(num_tokens)
    if itl_s is not None:
        INTER_TOKEN_LATENCY.labels(name).observe(itl_s)


def record_request_finished(*, finish_reason: str, e2e_s: float, prompt_tokens: int,
                            generation_tokens: int) -> None:
    """End of a request: finish_reason is "stop", "length", "abort" or "error"."""
    name = _name()
    REQUEST_SUCCESS.labels(name, finish_reason).inc()
    E2E_REQUEST_LATENCY.labels(name).observe(e2e_s)
    REQUEST_PROMPT_TOKENS.labels(name).observe(prompt_tokens)
    REQUEST_GENERATION_TOKENS.labels(name).observe(generation_tokens)


class RequestTimer:
    """Per-request timing from the stream the API server serves: call `on_tokens` for each engine
    output that carries new tokens, then `finish` exactly once."""

    def __init__(self, prompt_tokens: int, arrival: float | None = None) -> None:
        self.arrival = time.monotonic() if arrival is None else arrival
        self.prompt_tokens = prompt_tokens
        self.generation_tokens = 0
        self._last: float | None = None
        self._finished = False

    def on_tokens(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            record_first_token(now - self.arrival, self.prompt_tokens)
            record_new_tokens(num_tokens, None)
        else:
            record_new_tokens(num_tokens, now - self._last)
        self._last = now
        self.generation_tokens += num_tokens

    def finish(self, finish_reason: str) -> None:
        if self._finished:
            return
        self._finished = True
        record_request_finished(finish_reason=finish_reason, e2e_s=time.monotonic() - self.arrival,
                                prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens)


# ---- exposition --------------------------------------------------------------------------------

# Exposition text of the replicas on other nodes (multi-node data parallelism), by node: their
# processes write to their own node's folder, and the node sends that folder's samples to the head.
_remote: dict[str, str] = {}


def set_remote_samples(node: str, text: str | None) -> None:
    """The latest samples of `node`'s replicas (Prometheus text), or None to drop them (node gone)."""
    with _lock:
        if text is None:
            _remote.pop(node, None)
        else:
            _remote[node] = text


class _WithRemote:
    """This host's multiprocess samples with the remote nodes' merged in, family by family."""

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families

        families = {f.name: f for f in multiprocess.MultiProcessCollector(None, path=MULTIPROC_DIR).collect()}
        with _lock:
            texts = list(_remote.values())
        for text in texts:
            for fam in text_string_to_metric_families(text):
                if fam.name in families:
                    families[fam.name].samples.extend(fam.samples)
                else:
                    families[fam.name] = fam
        return list(families.values())


def metrics_response_body() -> bytes:
    """Prometheus text of every process' samples (what /metrics returns), remote replicas' included."""
    registry = CollectorRegistry()
    if _remote:
        registry.register(_WithRemote())
    else:
        multiprocess.MultiProcessCollector(registry, path=MULTIPROC_DIR)
    return prometheus_client.generate_latest(registry)


def mark_process_dead(pid: int) -> None:
    """Drops the live-gauge files of an exited process (engine or worker) so that its last
    queue sizes stop counting; call from the parent when a child process exits."""
    multiprocess.mark_process_dead(pid, path=MULTIPROC_DIR)
