"""Every environment variable vllm_neuron reads, in one place.

Values are read lazily, each time they are accessed (`envs.VLLM_NEURON_BACKEND`), so that a
process sees the environment it was started with and tests can monkeypatch os.environ.
Names and defaults are the seeds' (configuration reference, "Environment variables").

Parsing rules, for every variable:
* unset or empty -> the default;
* booleans accept 0/1/true/false (any case); anything else is a ValueError naming the variable;
* a malformed or out-of-range number is a ValueError naming the variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from vllm_neuron.logger import STREAMS, init_logger, warning_once

logger = init_logger(__name__)

_TRUE = ("1", "true")
_FALSE = ("0", "false")
_HUB_TRUE = ("1", "ON", "YES", "TRUE")  # huggingface_hub's own reading of HF_HUB_OFFLINE


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    return value.strip()


def _bool(name: str, default: bool = False) -> bool:
    raw = _raw(name)
    if raw is None:
        return default
    low = raw.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; valid values: 0, 1, true, false")


def _int(name: str, default: int | None = None, minimum: int | None = None) -> int | None:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def _float(
    name: str,
    default: float | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    min_exclusive: bool = False,
) -> float | None:
    raw = _raw(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{name}={raw!r} must be a finite number")
    if minimum is not None and (value <= minimum if min_exclusive else value < minimum):
        op = ">" if min_exclusive else ">="
        raise ValueError(f"{name}={value} must be {op} {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}={value} must be <= {maximum}")
    return value


def _str(name: str, default: str | None = None) -> str | None:
    raw = _raw(name)
    return default if raw is None else raw


def _choice(name: str, default: str | None, choices: tuple[str, ...]) -> str | None:
    raw = _raw(name)
    if raw is None:
        return default
    if raw.lower() not in choices:
        raise ValueError(f"{name}={raw!r}; valid values: {', '.join(choices)}")
    return raw.lower()


# ---------------------------------------------------------------------------------------------
# Compilation and caching
# ---------------------------------------------------------------------------------------------

BACKEND_NATIVE = "native"
BACKEND_EAGER = "eager"
_NATIVE_ALIASES = ("neuron_native", "neuron")


def _backend() -> str:
    """VLLM_NEURON_BACKEND: the compilation route.

    Unset, "neuron_native" or "neuron" -> "native" (torch.compile with static shapes, the
    default). "eager" -> run the same graphs uncompiled (our addition). "vllm_neuron" selects
    the deprecated XLA route on Neuron; there is no XLA route here, so it is an error rather
    than a silent switch. Any other value logs a warning and selects "native" (seeds).
    """
    raw = _raw("VLLM_NEURON_BACKEND")
    if raw is None or raw in _NATIVE_ALIASES:
        return BACKEND_NATIVE
    if raw == BACKEND_EAGER:
        return BACKEND_EAGER
    if raw == "vllm_neuron":
        raise ValueError(
            "VLLM_NEURON_BACKEND='vllm_neuron' selects the deprecated XLA route, which is not "
            "available here; valid values: neuron_native (or neuron, or unset) for the native "
            "torch.compile route, eager for uncompiled graphs"
        )
    warning_once(
        logger,
        "VLLM_NEURON_BACKEND=%r is not a valid value (valid: neuron_native, neuron, eager); "
        "selecting the native route",
        raw,
    )
    return BACKEND_NATIVE


def _use_v2_model_runner() -> bool | None:
    """VLLM_USE_V2_MODEL_RUNNER: unset -> None (automatic: MRv2 for supported dense
    configurations, MRv1 otherwise), "0" -> False (force MRv1), "1" -> True (force MRv2)."""
    raw = _raw("VLLM_USE_V2_MODEL_RUNNER")
    if raw is None:
        return None
    if raw == "0":
        return False
    if raw == "1":
        return True
    raise ValueError(
        f"VLLM_USE_V2_MODEL_RUNNER={raw!r} is not valid; valid values: unset (automatic), "
        "0 (Model Runner V1), 1 (Model Runner V2)"
    )


def _cache_root() -> str:
    # Not vLLM's ~/.cache/vllm: our compile artifacts are not vLLM's, and sharing the folder
    # with an installed vLLM would mix two incompatible caches.
    return os.path.expanduser(_str("VLLM_CACHE_ROOT") or os.path.join("~", ".cache", "vllm_neuron"))


def _logging_stream() -> str:
    """VLLM_LOGGING_STREAM (vLLM's variable): where log lines go, `ext://sys.stdout` (the default) or
    `ext://sys.stderr`; child processes inherit it. `vllm-neuron generate` sets stderr for its own run, so that
    stdout holds only the answers."""
    raw = _str("VLLM_LOGGING_STREAM") or "ext://sys.stdout"
    if raw not in STREAMS:
        raise ValueError(f"VLLM_LOGGING_STREAM={raw!r} is not valid; valid values: {', '.join(STREAMS)}")
    return raw


def _log_level() -> str:
    """VLLM_NEURON_LOG_LEVEL, upper-cased; DEBUG, INFO, WARNING, ERROR or CRITICAL."""
    raw = (_str("VLLM_NEURON_LOG_LEVEL") or "INFO").upper()
    if raw == "WARN":
        raw = "WARNING"
    valid = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    if raw not in valid:
        raise ValueError(f"VLLM_NEURON_LOG_LEVEL={raw!r} is not valid; valid values: {', '.join(valid)}")
    return raw


@dataclass(frozen=True)
class EnvVar:
    name: str
    read: Callable[[], Any]
    doc: str


_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        # -- compilation and caching --
        EnvVar("VLLM_NEURON_BACKEND", _backend, _backend.__doc__ or ""),
        EnvVar(
            "NEURON_COMPILED_ARTIFACTS",
            lambda: _str("NEURON_COMPILED_ARTIFACTS"),
            "Folder of compiled graphs: loaded when valid artifacts exist, filled otherwise. "
            "Takes precedence over $VLLM_CACHE_ROOT/compiled_artifacts.",
        ),
        EnvVar(
            "VLLM_NEURON_INDUCTOR_CACHE_DIR",
            lambda: _str("VLLM_NEURON_INDUCTOR_CACHE_DIR"),
            "Folder of inductor's content-addressed cache (compiled C++ kernels and their headers), "
            "default <compile cache>/inductor. Point compile caches with different folders at one "
            "place to share what they have in common (the test suite does).",
        ),
        EnvVar(
            "VLLM_NEURON_KERNEL_CACHE_DIR",
            lambda: _str("VLLM_NEURON_KERNEL_CACHE_DIR"),
            "Folder of the custom CPU kernels' builds (one sub-folder per source digest and instruction set), "
            "default $VLLM_CACHE_ROOT/kernels. Point cache roots that differ at one place to build the kernels "
            "once (the test suite does).",
        ),
        EnvVar(
            "VLLM_NEURON_KV_OFFLOAD_DIR",
            lambda: os.path.expanduser(_str("VLLM_NEURON_KV_OFFLOAD_DIR") or os.path.join(_cache_root(), "kv_tier")),
            "Folder of the second KV tier (--kv-offloading-size): blocks by prefix-cache hash, in a sub-folder per "
            "model and KV layout; kept across restarts and shared by the replicas that point at it. Default "
            "$VLLM_CACHE_ROOT/kv_tier.",
        ),
        EnvVar(
            "VLLM_NEURON_CPU_COMPILE",
            lambda: _bool("VLLM_NEURON_CPU_COMPILE"),
            "Compile-only mode for a device that is not present. Not supported yet: 1 is refused at "
            "start-up (compile on a machine with the device; share with NEURON_LIBTORCH_REMOTE_CACHE).",
        ),
        EnvVar(
            "NEURON_PLATFORM_TARGET_OVERRIDE",
            lambda: _str("NEURON_PLATFORM_TARGET_OVERRIDE"),
            "Target device type for compile-only mode. Not supported yet: refused at start-up when set.",
        ),
        EnvVar(
            "NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS",
            lambda: _int("NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS", None, minimum=1),
            "Number of processes compiling the buckets missing from the compile cache during warm-up "
            "(each holds its own copy of the weights and KV pool); the engine then loads their saved "
            "graphs. 1 or unset: one bucket after the other.",
        ),
        EnvVar(
            "NEURON_LIBTORCH_REMOTE_CACHE",
            lambda: _str("NEURON_LIBTORCH_REMOTE_CACHE"),
            "Shared (NFS-style) folder: buckets missing from the local compile cache are taken from "
            "<folder>/<key>/ before compiling, and what warm-up compiled is published there, so "
            "other machines of the same kind (the key covers the CPU/GPU and compiler) skip compilation.",
        ),
        EnvVar(
            "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE",
            lambda: _bool("NEURON_LIBTORCH_DISABLE_COMPILE_CACHE"),
            "Disable the compile cache entirely: recompile every graph on every start. Default 0.",
        ),
        EnvVar(
            "NEURON_LIBTORCH_COMPILATION_TIMEOUT",
            lambda: _int("NEURON_LIBTORCH_COMPILATION_TIMEOUT", None, minimum=1),
            "Timeout in seconds for compiling one graph: warm-up fails naming the bucket (unset: no "
            "timeout). Needs warm-up on the process's main thread.",
        ),
        EnvVar(
            "VLLM_NEURON_DISABLE_WARMUP_COMPILE",
            lambda: _bool("VLLM_NEURON_DISABLE_WARMUP_COMPILE"),
            "Treat a compile-cache miss during warm-up as a fatal error (all graphs must be "
            "pre-compiled). Default 0.",
        ),
        EnvVar(
            "VLLM_NEURON_AOT_COMPILE",
            lambda: _bool("VLLM_NEURON_AOT_COMPILE", True),
            "Save each bucket's compiled graph ahead of time (dynamo bytecode, guards and inductor "
            "graph) in the compile cache, so a warm start loads it instead of re-tracing the model. "
            "0 falls back to plain torch.compile. Default 1.",
        ),
        EnvVar(
            "VLLM_NEURON_CUDA_GRAPHS",
            lambda: _choice("VLLM_NEURON_CUDA_GRAPHS", "decode", ("decode", "all", "off")),
            "On CUDA, which compiled bucket graphs are captured once as CUDA graphs and replayed: "
            "decode (default), all (prefill and speculative verification buckets too) or off. Ignored on CPU and with eager execution.",
        ),
        EnvVar(
            "VLLM_CACHE_ROOT",
            _cache_root,
            "Root folder for caches; default ~/.cache/vllm_neuron (the seeds' ~/.cache/vllm is "
            "vLLM's own and is not shared with it).",
        ),
        EnvVar(
            "VLLM_NEURON_GGUF_CACHE_MAX_GIB",
            lambda: _float("VLLM_NEURON_GGUF_CACHE_MAX_GIB", 4.0, minimum=0.0),
            "Largest GGUF model, in GiB of dequantized weights, whose weights are cached as "
            "safetensors under $VLLM_CACHE_ROOT/gguf (configs and tokenizer are always cached). "
            "Default 4; 0 disables the weight cache.",
        ),
        # -- runtime and execution --
        EnvVar(
            "VLLM_NEURON_CPU_MODE",
            lambda: _bool("VLLM_NEURON_CPU_MODE"),
            "Force the CPU device even when an accelerator is present (development/testing). "
            "Default 0.",
        ),
        EnvVar("VLLM_NEURON_LOG_LEVEL", _log_level, _log_level.__doc__ or ""),
        EnvVar("VLLM_LOGGING_STREAM", _logging_stream, _logging_stream.__doc__ or ""),
        EnvVar(
            "VLLM_NEURON_DISABLE_NKI_KERNELS",
            lambda: _bool("VLLM_NEURON_DISABLE_NKI_KERNELS"),
            "Disable the project's custom kernels, forcing the plain torch paths. Default 0.",
        ),
        EnvVar(
            "VLLM_NEURON_CPU_ISA",
            lambda: _choice("VLLM_NEURON_CPU_ISA", None, ("avx512bf16", "avx2", "generic")),
            "CPU class the custom kernels are built for: avx512bf16, avx2 or generic (unset: the best "
            "this CPU runs). Forcing a lower class tests its code path; a higher one is refused.",
        ),
        EnvVar(
            "VLLM_NEURON_KV_PREFAULT_MB",
            lambda: _int("VLLM_NEURON_KV_PREFAULT_MB", 8, minimum=0),
            "On CPU, the KV pool's pages are written in sweeps of at least this many MiB ahead of the "
            "blocks the steps use, instead of one page fault at a time inside the steps (each fault costs "
            "~100 us on a VM); an engine idle for a quarter second sweeps up to 512 MiB ahead in 2 MiB "
            "pieces; the block pool reuses freed blocks before it reaches past the backed ones. 0 turns it off "
            "(blocks then go in id order). Default 8.",
        ),
        EnvVar(
            "VLLM_NEURON_HUGE_PAGES",
            lambda: _bool("VLLM_NEURON_HUGE_PAGES", True),
            "On CPU, weights and their packed copies live in memory asked for in 2 MiB pages (transparent "
            "huge pages, MADV_HUGEPAGE) where the kernel allows it: fewer TLB misses and prefetcher stops "
            "in the weight stream of every step. 0 keeps torch's 4 KiB pages. Default 1.",
        ),
        EnvVar(
            "VLLM_NEURON_KV_HUGE_PAGES",
            lambda: _bool("VLLM_NEURON_KV_HUGE_PAGES", False),
            "On CPU, the KV pool in 2 MiB pages too (with VLLM_NEURON_HUGE_PAGES on): decode attention over "
            "many long sequences runs faster (batch 16 at 1,500 tokens: ~28% shorter steps), but backing a "
            "fresh huge page can stall for compaction, which cost one-at-a-time requests 20-30 ms of TTFT "
            "on our test VM. For long-context, high-batch serving. Default 0.",
        ),
        EnvVar(
            "VLLM_NEURON_ATTN_MASK_TORCH",
            lambda: _bool("VLLM_NEURON_ATTN_MASK_TORCH"),
            "Build the decode attention mask with plain torch ops instead of a mask kernel. There is "
            "no mask kernel here: 1 is refused at start-up (VLLM_NEURON_DISABLE_NKI_KERNELS=1 selects "
            "the torch attention and its torch mask).",
        ),
        EnvVar("VLLM_USE_V2_MODEL_RUNNER", _use_v2_model_runner, _use_v2_model_runner.__doc__ or ""),
        # -- memory management --
        EnvVar(
            "VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION",
            lambda: _float(
                "VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION", 0.30, minimum=0.0, maximum=1.0,
                min_exclusive=True,
            ),
            "Fractional cap of the total budget for default KV sizing, in (0, 1]. Default 0.30. "
            "Headroom mode bypasses it.",
        ),
        EnvVar(
            "VLLM_NEURON_RESERVED_HEADROOM_GIB",
            lambda: _float("VLLM_NEURON_RESERVED_HEADROOM_GIB", None, minimum=0.0),
            "Explicit reserve per worker in GiB; when set (zero included) KV sizing uses "
            "headroom mode: gpu_memory_utilization treated as 1.0 and no fractional cap.",
        ),
        EnvVar(
            "VLLM_NEURON_MIN_KV_BUDGET_GIB",
            lambda: _float("VLLM_NEURON_MIN_KV_BUDGET_GIB", 1.0, minimum=0.0),
            "Minimum KV budget in GiB; start-up fails fast below it. Default 1.0.",
        ),
        EnvVar(
            "VLLM_ENGINE_ITERATION_TIMEOUT_S",
            lambda: _float("VLLM_ENGINE_ITERATION_TIMEOUT_S", 60.0, minimum=0.0, min_exclusive=True),
            "Seconds an engine replica with requests in flight may stay silent (vLLM's variable): past "
            "it the replica counts as hung, its requests fail and its process is killed. Default 60.",
        ),
        # -- multimodal --
        EnvVar(
            "VLLM_IMAGE_FETCH_TIMEOUT",
            lambda: _float("VLLM_IMAGE_FETCH_TIMEOUT", 5.0, minimum=0.0, min_exclusive=True),
            "Seconds to fetch one http(s) media URL (vLLM's variable). Default 5.",
        ),
        EnvVar(
            "VLLM_MEDIA_URL_ALLOW_REDIRECTS",
            lambda: _bool("VLLM_MEDIA_URL_ALLOW_REDIRECTS", True),
            "Follow redirects of http(s) media URLs, each hop checked like the first URL (vLLM's variable). "
            "Default 1; 0 refuses them.",
        ),
        EnvVar(
            "VLLM_MEDIA_MAX_BYTES",
            lambda: _int("VLLM_MEDIA_MAX_BYTES", 20 * 2**20, minimum=1),
            "Largest media item, in bytes, read from an http(s) URL or a local file. Default 20 MiB.",
        ),
        EnvVar(
            "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB",
            lambda: _int("VLLM_MAX_AUDIO_CLIP_FILESIZE_MB", 25, minimum=1),
            "Largest audio file, in MB, /v1/audio/transcriptions and /translations accept (vLLM's variable); "
            "larger uploads get a 413 before any decoding. Default 25.",
        ),
        EnvVar(
            "VLLM_NEURON_MAX_AUDIO_SECONDS",
            lambda: _float("VLLM_NEURON_MAX_AUDIO_SECONDS", 3600.0, minimum=1.0),
            "Longest audio, in seconds, one request may carry (decoding stops past it and the request gets a "
            "400). Default 3600.",
        ),
        # -- parallelism --
        EnvVar(
            "VLLM_NEURON_DIST_TIMEOUT_S",
            lambda: _float("VLLM_NEURON_DIST_TIMEOUT_S", 120.0, minimum=1.0),
            "Tensor parallelism: seconds a collective waits for the other ranks before the step fails and "
            "the engine reports the rank as hung (a rank that exits fails it at once). Covers the start-up "
            "too, where ranks compile the same bucket at slightly different speeds. Default 120.",
        ),
        EnvVar(
            "VLLM_NEURON_PP_MICRO_BATCHES",
            lambda: _int("VLLM_NEURON_PP_MICRO_BATCHES", 1, minimum=1),
            "Pipeline parallelism: the micro-batches a decode step's rows are split into between stages, so "
            "that stages overlap (model/pipeline_stage.py). Default 1 (one piece): each micro-batch re-reads a "
            "stage's weights, and on one CPU host that cost more than the overlap saved "
            "(benchmarks/pp_step_times.py).",
        ),
        # -- metrics --
        EnvVar(
            "VLLM_LOG_STATS_INTERVAL",
            lambda: _float("VLLM_LOG_STATS_INTERVAL", 10.0, minimum=0.0, min_exclusive=True),
            "Seconds between the server's engine stats lines (vLLM's variable). Default 10; "
            "--disable-log-stats turns them off.",
        ),
        EnvVar(
            "VLLM_NEURON_STEP_TIMING",
            lambda: _bool("VLLM_NEURON_STEP_TIMING", True),
            "Per-step observation: each bucket's execution-time and fill-ratio histograms and the served step "
            "shapes in /metrics, the per-step DEBUG line, the bucket advisor's summary in the compile cache "
            "folder and its hint. Default 1; 0 turns them all off (to measure what they cost).",
        ),
        # -- profiling (vLLM's variables) --
        EnvVar(
            "VLLM_TORCH_PROFILER_DIR",
            lambda: _str("VLLM_TORCH_PROFILER_DIR"),
            "Folder for torch.profiler traces (Chrome trace JSON, one file per process: API server, engine "
            "cores, tensor-parallel ranks). Set: /start_profile and /stop_profile on the server and "
            "LLM.start_profile() / stop_profile() offline record between the two calls. Unset: they are refused.",
        ),
        EnvVar(
            "VLLM_TORCH_PROFILER_RECORD_SHAPES",
            lambda: _bool("VLLM_TORCH_PROFILER_RECORD_SHAPES"),
            "Traces record each op's input shapes. Default 0.",
        ),
        EnvVar(
            "VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY",
            lambda: _bool("VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY"),
            "Traces record tensor allocations. Default 0.",
        ),
        EnvVar(
            "VLLM_TORCH_PROFILER_WITH_STACK",
            lambda: _bool("VLLM_TORCH_PROFILER_WITH_STACK", True),
            "Traces record each op's Python stack (vLLM's default, 1; costly on CPU: 0 for timings).",
        ),
        EnvVar(
            "VLLM_TORCH_PROFILER_WITH_FLOPS",
            lambda: _bool("VLLM_TORCH_PROFILER_WITH_FLOPS"),
            "Traces estimate the FLOPs of matrix multiplications and convolutions. Default 0.",
        ),
        EnvVar(
            "VLLM_ENABLE_RESPONSES_API_STORE",
            lambda: _bool("VLLM_ENABLE_RESPONSES_API_STORE"),
            "1: /v1/responses stores its responses in memory (previous_response_id, GET /v1/responses/{id}), "
            "as --enable-store does (vLLM's variable). Default off.",
        ),
        EnvVar(
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
            lambda: _bool("VLLM_ALLOW_RUNTIME_LORA_UPDATING"),
            "1: the server offers /v1/load_lora_adapter and /v1/unload_lora_adapter (LoRA adapters added and "
            "removed while it runs, with --enable-lora); vLLM's variable. Default off (the routes answer 404).",
        ),
        # -- models by Hugging Face id (huggingface_hub's own variables; HF_TOKEN is read by huggingface_hub and
        # never logged) --
        EnvVar(
            "HF_ENDPOINT",
            lambda: _str("HF_ENDPOINT"),
            "The Hugging Face hub that `org/name` models come from (default https://huggingface.co): a mirror, "
            "or the tests' local server.",
        ),
        EnvVar(
            "HF_HUB_OFFLINE",
            lambda: (_raw("HF_HUB_OFFLINE") or _raw("TRANSFORMERS_OFFLINE") or "").upper() in _HUB_TRUE,
            "1: models by id come from the cache only (--download-dir or the Hugging Face cache); a file missing "
            "there is named in the error. TRANSFORMERS_OFFLINE=1 means the same, as in huggingface_hub.",
        ),
        EnvVar(
            "PROMETHEUS_MULTIPROC_DIR",
            lambda: _str("PROMETHEUS_MULTIPROC_DIR"),
            "prometheus_client multiprocess folder; unset: the metrics module creates a "
            "temporary one. Wipe it between server restarts.",
        ),
    )
}

ALL_VARIABLES: tuple[str, ...] = tuple(_VARS)


def __getattr__(name: str) -> Any:
    var = _VARS.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_VARS))


def doc(name: str) -> str:
    """The documentation line of one variable."""
    if name not in _VARS:
        raise ValueError(f"unknown environment variable {name!r}; known: {', '.join(_VARS)}")
    return _VARS[name].doc


def compile_cache_dir() -> str:
    """Folder of the compile cache: NEURON_COMPILED_ARTIFACTS when set, else
    $VLLM_CACHE_ROOT/compiled_artifacts (VLLM_CACHE_ROOT defaults to ~/.cache/vllm_neuron)."""
    explicit = _str("NEURON_COMPILED_ARTIFACTS")
    if explicit is not None:
        return os.path.abspath(os.path.expanduser(explicit))
    return os.path.join(_cache_root(), "compiled_artifacts")


def check_supported() -> None:
    """Refuses, at start-up, the seeds' variables whose feature is not built here (set to anything
    but their default), naming the variable: none of them is ever read and ignored."""
    refused = []
    if _bool("VLLM_NEURON_CPU_COMPILE") or _str("NEURON_PLATFORM_TARGET_OVERRIDE") is not None:
        refused.append("VLLM_NEURON_CPU_COMPILE / NEURON_PLATFORM_TARGET_OVERRIDE (compiling for a device "
                       "that is not present: compile on a machine with the device, e.g. `vllm-neuron compile`, "
                       "and share the graphs with NEURON_LIBTORCH_REMOTE_CACHE)")
    if _bool("VLLM_NEURON_ATTN_MASK_TORCH"):
        refused.append("VLLM_NEURON_ATTN_MASK_TORCH (there is no mask kernel to replace: the custom attention "
                       "kernel needs no mask, and VLLM_NEURON_DISABLE_NKI_KERNELS=1 selects the torch attention "
                       "with a torch-built mask)")
    if refused:
        raise ValueError("not supported yet by vllm-neuron: " + "; ".join(refused))


def describe() -> dict[str, Any]:
    """Parsed values of the variables that are set in the environment, for the start-up log.

    Raises the variable's ValueError when one of them is malformed, so that a bad value is
    reported at start-up rather than the first time it is read.
    """
    return {name: var.read() for name, var in _VARS.items() if _raw(name) is not None}
