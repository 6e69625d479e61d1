"""torch.profiler traces (vLLM's VLLM_TORCH_PROFILER_DIR) and the ranges that name what a step spends time on.

`TraceSession` runs one process' profiler: every process of an engine (the API server, each engine core, each
tensor-parallel rank) writes its own Chrome trace JSON (Perfetto and chrome://tracing read it) into
$VLLM_TORCH_PROFILER_DIR, named `<tag>.<role><TRACE_SUFFIX>`; one start/stop pair shares one tag across the
processes. The companions of vLLM's variable pick what is recorded (VLLM_TORCH_PROFILER_RECORD_SHAPES,
_WITH_PROFILE_MEMORY, _WITH_STACK, _WITH_FLOPS). Every thread of the process is recorded (the step thread of
async scheduling included).

Ranges: `phase(name)` / `@ranged(name)` put a range on the trace while a profiler runs and cost one attribute
read otherwise. The engine's phases are PHASES; each bucket graph call is a "graph" range around a
"bucket:<graph name>" one. Ranges always sit outside compiled graphs (torch.compile would otherwise have to
trace them).
"""
from __future__ import annotations

import contextlib
import functools
import glob
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.autograd import profiler as _autograd_profiler

from vllm_neuron import envs
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

TRACE_SUFFIX = ".pt.trace.json"
BUCKET_PREFIX = "bucket:"
# Host phases of a step, in order: the engine core's schedule, the runner's input building, the bucket graph,
# the runner's host sampling (and whatever follows the graph), the core's output (scheduler update, outputs),
# the front end's detokenization.
PHASES = ("schedule", "build_inputs", "graph", "sample", "output", "detokenize")
DISABLED = ("profiling is off: start the engine with VLLM_TORCH_PROFILER_DIR set to a folder for the traces "
            "(the server: in `vllm-neuron serve`'s environment) to use /start_profile, /stop_profile and "
            "LLM.start_profile() / stop_profile()")

F = TypeVar("F", bound=Callable[..., Any])
_NULL = contextlib.nullcontext()


class ProfilerError(RuntimeError):
    """Profiling asked for in a state that cannot honour it (off, already running, not running)."""


def active() -> bool:
    """Whether a profiler records in this process (torch's own flag; True if torch no longer has it)."""
    return getattr(_autograd_profiler, "_is_profiler_enabled", True)


def phase(name: str):
    """A context manager: a `name` range while a profiler runs, nothing otherwise."""
    return torch.profiler.record_function(name) if active() else _NULL


def ranged(name: str) -> Callable[[F], F]:
    """Decorator: the function's calls are `name` ranges while a profiler runs."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            if not active():
                return fn(*args, **kwargs)
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return run  # type: ignore[return-value]
    return wrap


def trace_dir() -> str:
    """$VLLM_TORCH_PROFILER_DIR, made absolute and created; ProfilerError when it is unset."""
    raw = envs.VLLM_TORCH_PROFILER_DIR
    if raw is None:
        raise ProfilerError(DISABLED)
    path = os.path.abspath(os.path.expanduser(raw))
    os.makedirs(path, exist_ok=True)
    return path


def new_tag() -> str:
    """A name shared by the trace files of one start/stop pair."""
    return time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"


def trace_files(tag: str) -> list[str]:
    """The trace files of one start/stop pair, every process'."""
    return sorted(glob.glob(os.path.join(trace_dir(), glob.escape(tag) + ".*" + TRACE_SUFFIX)))


def _all_threads() -> Any:
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # an older torch: the thread that starts the profiler only
        return None


class TraceSession:
    """This process' profiler: start(role, tag) ... stop() -> the trace file."""

    def __init__(self) -> None:
        self._prof: torch.profiler.profile | None = None
        self._path = ""

    @property
    def running(self) -> bool:
        return self._prof is not None

    def start(self, role: str, tag: str) -> None:
        directory = trace_dir()
        if self._prof is not None:
            raise ProfilerError("a profile is already running: stop it first (/stop_profile, LLM.stop_profile())")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=activities, record_shapes=envs.VLLM_TORCH_PROFILER_RECORD_SHAPES,
            profile_memory=envs.VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY,
            with_stack=envs.VLLM_TORCH_PROFILER_WITH_STACK, with_flops=envs.VLLM_TORCH_PROFILER_WITH_FLOPS,
            experimental_config=_all_threads())
        prof.start()
        self._prof, self._path = prof, os.path.join(directory, f"{tag}.{role}{TRACE_SUFFIX}")
        logger.info("Profiling %s: torch.profiler started (trace %s at stop)", role, self._path)

    def stop(self) -> str:
        """Stops the profiler and writes the trace; its path."""
        if self._prof is None:
            raise ProfilerError("no profile is running: start one first (/start_profile, LLM.start_profile())")
        prof, self._prof = self._prof, None
        prof.stop()
        t0 = time.perf_counter()
        prof.export_chrome_trace(self._path)
        logger.info("Profile written: %s (%.1f MiB in %.1f s)", self._path, os.path.getsize(self._path) / 2**20,
                    time.perf_counter() - t0)
        return self._path
