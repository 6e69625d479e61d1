"""Parallel bucket compilation (`NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS` > 1).

Warm-up compiles one graph per bucket, one after the other. With N workers the buckets missing from
the compile cache are compiled first by N spawned processes, each building the same runner (model,
KV pool of the same size, hence the same cache key) and taking buckets from a shared queue; each saves
its graphs into the persistent compile cache (worker/compilation.py) but leaves the manifest to this
process. The engine's own warm-up then loads every saved graph without re-tracing.

Costs: each worker holds its own copy of the weights and of the KV pool while it compiles, and the
machine's cores are shared between the workers (each gets cores / N torch threads). A worker that
fails, times out (NEURON_LIBTORCH_COMPILATION_TIMEOUT, enforced in the worker and, if it hangs where a
signal cannot reach, by this process) or dies fails warm-up with the bucket it was compiling named.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from vllm_neuron import envs
from vllm_neuron.logger import init_logger
from vllm_neuron.model.loader import load_checkpoint
from vllm_neuron.worker.runner_base import ModelRunnerBase
from vllm_neuron.worker.runner_factory import create_runner

logger = init_logger(__name__)

# A worker still in one bucket this long after NEURON_LIBTORCH_COMPILATION_TIMEOUT has not been stopped
# by its own timer (native code ignores the signal): it is killed.
_KILL_GRACE_S = 30.0
_POLL_S = 0.5


@dataclass
class BucketFailure:
    name: str
    reason: str


class ParallelCompileError(RuntimeError):
    def __init__(self, failures: list[BucketFailure]) -> None:
        self.failures = failures
        super().__init__("Parallel compilation failed: " + "; ".join(f"bucket {f.name}: {f.reason}"
                                                                      for f in failures))


@contextlib.contextmanager
def _children_allowed():
    """The API server's EngineCore is a daemonic process, which multiprocessing forbids to start children
    (they could outlive it unnoticed). Ours are daemonic themselves and are killed and joined below, so
    the flag is lifted while they start."""
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon
        else:
            config.pop("daemon", None)


def run_bucket_workers(names: list[str], workers: int, target: Callable[..., None], args: tuple,
                       timeout: int | None = None) -> dict[str, float]:
    """Runs `target(tasks, results, *args)` in `workers` spawned processes that take bucket names from
    `tasks` (None: stop) and report on `results`: ("start", name), ("done", name, seconds) or
    ("fail", name, reason). Returns {name: seconds}; raises ParallelCompileError naming every bucket
    that failed, timed out, or was being compiled by a worker that died."""
    ctx = multiprocessing.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    for name in names:
        tasks.put(name)
    n = max(1, min(workers, len(names)))
    for _ in range(n):
        tasks.put(None)
    procs = [ctx.Process(target=target, args=(tasks, results, *args), name=f"compile-worker-{i}", daemon=True)
             for i in range(n)]
    with _children_allowed():
        for p in procs:
            p.start()
    by_pid = {p.pid: p for p in procs}
    current: dict[int, tuple[str, float]] = {}  # pid -> (bucket, started)
    seen_dead: set[int] = set()
    done: dict[str, float] = {}
    failures: list[BucketFailure] = []
    bar = tqdm(total=len(names), desc=f"Compiling buckets ({n} workers)", unit="graph", disable=None)
    try:
        while len(done) + len(failures) < len(names):
            try:
                msg = results.get(timeout=_POLL_S)
            except queue.Empty:
                msg = None
            if msg is not None:
                kind, pid, name = msg[:3]
                if kind == "start":
                    current[pid] = (name, time.monotonic())
                    logger.info("Bucket %s: compiling in worker %d ...", name, pid)
                    continue
                current.pop(pid, None)
                if kind == "done":
                    done[name] = msg[3]
                    logger.info("Bucket %s: compiled in worker %d in %.1f s (%d/%d)", name, pid, msg[3],
                                len(done), len(names))
                else:
                    failures.append(BucketFailure(name, msg[3]))
                    logger.error("Bucket %s: failed in worker %d: %s", name, pid, msg[3])
                bar.update(1)
                continue
            for pid, (name, started) in list(current.items()):
                proc = by_pid[pid]
                if not proc.is_alive() and pid not in seen_dead:
                    seen_dead.add(pid)  # its last report may still be in the queue: look once more first
                    continue
                if timeout is not None and time.monotonic() - started > timeout + _KILL_GRACE_S:
                    proc.kill()
                    proc.join(5)
                    failures.append(BucketFailure(name, f"compilation took longer than "
                                                        f"NEURON_LIBTORCH_COMPILATION_TIMEOUT={timeout} s (worker "
                                                        f"killed)"))
                elif not proc.is_alive():
                    failures.append(BucketFailure(name, f"the compile worker died (exit code {proc.exitcode})"))
                else:
                    continue
                del current[pid]
                bar.update(1)
            if msg is None and not any(p.is_alive() for p in procs) and results.empty():
                # Every worker gone: the buckets they were in, then those no worker took.
                for pid, (name, _) in current.items():
                    failures.append(BucketFailure(name, f"the compile worker died (exit code "
                                                        f"{by_pid[pid].exitcode})"))
                current.clear()
                left = [x for x in names if x not in done and x not in {f.name for f in failures}]
                codes = sorted({p.exitcode for p in procs})
                failures += [BucketFailure(x, f"no compile worker left to compile it (exit codes {codes})")
                             for x in left]
    finally:
        bar.close()
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    if failures:
        raise ParallelCompileError(failures)
    return done


def compile_worker(tasks: Any, results: Any, config: Any, device: Any, dtype: Any, backend: str, num_blocks: int,
                   kv_sizing: dict | None, key: str, threads: int) -> None:
    """One worker process: builds the runner the engine built, then compiles the buckets it takes."""
    torch.set_num_threads(threads)
    pid = os.getpid()
    runner = None
    try:
        runner = create_runner(config, load_checkpoint(config.model), device, dtype, backend)
        runner.load_model()
        runner._kv_sizing = kv_sizing
        runner.init_kv_cache(num_blocks)
        compiler = runner.compiler
        compiler.writes_manifest = False  # the engine's process records what the workers saved
        if compiler.key != key:
            raise RuntimeError(f"the worker's compile cache key {compiler.key} is not the engine's {key}")
        graphs = {spec.name: spec for spec in runner.graph_names()}
    except BaseException as e:  # noqa: BLE001 - reported against the bucket this worker would take next
        name = tasks.get()
        if name is not None:
            results.put(("fail", pid, name, f"the compile worker could not start: {type(e).__name__}: {e}"))
        return
    while True:
        name = tasks.get()
        if name is None:
            return
        results.put(("start", pid, name))
        try:
            spec = graphs[name]
            rec = compiler.warm(name, lambda: runner.warm_graph(spec))
            results.put(("done", pid, name, rec.seconds))
        except BaseException as e:  # noqa: BLE001 - one bucket's failure, reported by name
            results.put(("fail", pid, name, f"{type(e).__name__}: {e}"))


def compile_missing(runner: ModelRunnerBase) -> None:
    """NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS > 1: the runner's buckets missing from the compile cache are
    compiled by that many processes, before its warm-up loads them (the engine calls this after the KV cache
    is sized, so that the workers compile for the same pool)."""
    workers = envs.NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS or 1
    compiler = runner.compiler
    if runner.backend == "eager" or workers <= 1 or compiler.disabled or compiler.fail_on_miss:
        return  # (VLLM_NEURON_DISABLE_WARMUP_COMPILE: a missing bucket stays fatal)
    missing = compiler.missing([g.name for g in runner.graph_names()])
    if len(missing) <= 1:
        return
    n = min(workers, len(missing))
    threads = max(1, torch.get_num_threads() // n)
    logger.info("Compiling %d buckets in %d worker processes (%d torch threads each; each holds its own "
                "copy of the weights and the KV pool): %s", len(missing), n, threads, ", ".join(missing))
    t0 = time.perf_counter()
    seconds = run_bucket_workers(missing, n, compile_worker, (
        runner.config, runner.device, runner.dtype, runner.backend, compiler.num_blocks, runner._kv_sizing,
        compiler.key, threads), timeout=compiler.timeout)
    compiler.record_compiled(seconds)
    logger.info("Parallel compilation of %d buckets done in %.1f s (%.1f s of compilation)", len(missing),
                time.perf_counter() - t0, sum(seconds.values()))
