"""CUDA graph capture and replay of a bucket's compiled graph: the seeds' "one NEFF per bucket" made
literal on CUDA, where a decode step of a small model is otherwise bound by the CPU launching a few
hundred kernels (the GPU idled 70% of a batch-1 step on an H200).

`ReplayedGraph` wraps one bucket's callable. Its first call runs the graph once outside any capture
(compiling it, warming up libraries) and returns that run's result, then captures it with those
arguments as the static inputs: nothing runs twice. Every later call fills the static inputs in
place and replays. An argument that is the very tensor captured (the KV cache, MRv2's slot state)
is read where it lives (so a tensor the graph updates in place must be passed as the same object every
call); any other tensor is copied into its captured twin, which must have the same shape; non-tensor
arguments must be equal. Outputs are cloned right after each replay: the captured ones live in the
memory pool all buckets share, which the next replay of another bucket may reuse. A capture that fails
(an op that cannot be captured) leaves the bucket running uncaptured, with a warning.

Capturing goes through a `GraphCapturer`, so the replay logic is tested on CPU with a fake one;
`CudaGraphCapturer` is the only code here that touches CUDA, and it is built only for a CUDA device.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree

from vllm_neuron import envs
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)


class GraphCapturer(Protocol):
    def first_run(self, run: Callable[[], Any]) -> Any:
        """Runs `run` once, uncaptured, as capturing requires first; returns its result."""

    def capture(self, run: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        """Records `run` (which reads the static inputs) without running it; returns (replay, the
        captured outputs, which each replay overwrites)."""


class CudaGraphCapturer:
    """torch.cuda.CUDAGraph capture on the current device; every bucket's graph shares one memory pool
    (buckets never run at the same time)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, run: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = run()
        return graph.replay, out

    def first_run(self, run: Callable[[], Any]) -> Any:
        """The uncaptured first run, on a side stream as capture requires of its warm-up."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = run()
        torch.cuda.current_stream().wait_stream(stream)
        return out


def cuda_graph_capturer(device: torch.device, backend: str) -> tuple[str, GraphCapturer | None]:
    """(VLLM_NEURON_CUDA_GRAPHS mode, the capturer or None): graphs are captured on CUDA for compiled
    buckets only; CPU and eager runs never touch CUDA graphs."""
    mode = envs.VLLM_NEURON_CUDA_GRAPHS
    if device.type != "cuda" or backend == "eager" or mode == "off":
        return "off", None
    logger.info("CUDA graphs: %s bucket graphs are captured once after compilation and replayed "
                "(VLLM_NEURON_CUDA_GRAPHS=%s)", "decode" if mode == "decode" else "every", mode)
    return mode, CudaGraphCapturer()


def wants_capture(mode: str, kind: str) -> bool:
    """Whether a bucket of `kind` ("prefill" / "decode") is captured under VLLM_NEURON_CUDA_GRAPHS=mode."""
    return mode == "all" or (mode == "decode" and kind == "decode")


class ReplayedGraph:
    def __init__(self, fn: Callable[..., Any], capturer: GraphCapturer, name: str) -> None:
        self.fn = fn
        self.capturer = capturer
        self.name = name
        self._replay: Callable[[], None] | None = None
        self._static: list[Any] = []
        self._spec: Any = None
        self._outputs: Any = None
        self.replays = 0
        self._failed = False

    def __call__(self, *args: Any) -> Any:
        if self._failed:
            return self.fn(*args)
        if self._replay is None:
            return self._capture(args)
        self._fill(args)
        self._replay()
        self.replays += 1
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self._outputs)

    def _run_static(self) -> Any:
        return self.fn(*pytree.tree_unflatten(self._static, self._spec))

    def _capture(self, args: tuple) -> Any:
        self._static, self._spec = pytree.tree_flatten(args)
        out = self.capturer.first_run(self._run_static)
        try:
            self._replay, self._outputs = self.capturer.capture(self._run_static)
        except Exception as e:  # noqa: BLE001 - e.g. an op that syncs with the host: run it uncaptured
            logger.warning("Bucket %s: CUDA graph capture failed (%s: %s); the bucket runs without graph replay",
                           self.name, type(e).__name__, e)
            self._failed = True
            self._static = []
            return out
        logger.info("Bucket %s: captured as a CUDA graph", self.name)
        return out

    def _fill(self, args: tuple) -> None:
        leaves, spec = pytree.tree_flatten(args)
        if spec != self._spec:
            raise RuntimeError(f"Bucket {self.name}: replayed with other arguments than it was captured with "
                               f"({spec} vs {self._spec})")
        for i, (new, static) in enumerate(zip(leaves, self._static)):
            if isinstance(static, torch.Tensor):
                if new is static:
                    continue  # the captured tensor itself (KV cache, slot state): read in place
                if not isinstance(new, torch.Tensor) or new.shape != static.shape:
                    raise RuntimeError(
                        f"Bucket {self.name}: input {i} is {_describe(new)}, captured as {_describe(static)}")
                static.copy_(new, non_blocking=True)
            elif new != static:
                raise RuntimeError(f"Bucket {self.name}: input {i} is {new!r}, captured as {static!r}")


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return repr(x)
