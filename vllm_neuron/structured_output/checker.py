"""A request's output constraint checked before the request starts: its size against `GrammarLimits`
(limits.py), then compiled once, so that an invalid grammar is a 400 before any stream begins.

In the API server (`GrammarChecker(..., in_process=False)`) the compilation runs in a child process of its
own, at low priority (nice 10): it can be killed when it runs past `--grammar-compile-timeout` (xgrammar's
native compilation cannot be interrupted in a thread), its CPU time yields to the engine's steps and the
event loop, and its compiled-grammar cache (bounded by `--grammar-cache-bytes`) is not the API server's
memory. The child is started on first use and again after it was killed. Constraints that compiled are
remembered by digest, so the engine client's own check of the same request costs a lookup.

The offline engine (`in_process=True`) compiles in the calling thread: its caller is the only user.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from multiprocessing.connection import Connection
from typing import Any

from vllm_neuron import heap
from vllm_neuron.config.grammar_limits import GrammarLimits
from vllm_neuron.logger import init_logger
from vllm_neuron.structured_output.limits import check_constraint, longest_token_chars
from vllm_neuron.structured_output.params import StructuredOutputsParams

logger = init_logger(__name__)

_REMEMBERED = 4096  # digests of constraints that compiled
_START_TIMEOUT_S = 120.0  # the child's start-up (imports, tokenizer info): not the request's compile time
_COMPILE_NICE = 10


class GrammarCompilerBusy(RuntimeError):
    """Another request's grammar holds the compiler past this request's time limit (a 503: retry)."""


class GrammarChecker:
    def __init__(self, tokenizer: Any, vocab_size: int, limits: GrammarLimits, *, in_process: bool = False) -> None:
        self.limits = limits
        self.in_process = in_process
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_token_chars: int | None = None
        self._digest_lock = threading.Lock()
        self._worker_lock = threading.Lock()  # one compile at a time in the child
        self._remembered: OrderedDict[bytes, None] = OrderedDict()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.cache_bytes = 0  # the compiler cache's size, as last reported
        self.compile_timeouts = 0

    @property
    def max_token_chars(self) -> int:
        if self._max_token_chars is None:
            self._max_token_chars = longest_token_chars(self._tokenizer)
        return self._max_token_chars

    def check(self, params: StructuredOutputsParams, max_tokens: int | None = None) -> None:
        """Blocking: ValueError naming the problem (too large, invalid, or compiling past the time limit);
        GrammarCompilerBusy when the compiler stays busy with another request past the time limit."""
        check_constraint(params, self.limits, max_tokens, self.max_token_chars)
        digest = hashlib.sha256(params.key().encode("utf-8", errors="replace")).digest()
        with self._digest_lock:
            if digest in self._remembered:
                self._remembered.move_to_end(digest)
                return
        self._compile(params)
        with self._digest_lock:
            self._remembered[digest] = None
            while len(self._remembered) > _REMEMBERED:
                self._remembered.popitem(last=False)

    def _compile(self, params: StructuredOutputsParams) -> None:
        if self.in_process:
            from vllm_neuron.structured_output.compiler import grammar_cache_for, make_tokenizer_info

            cache = grammar_cache_for(make_tokenizer_info(self._tokenizer, self._vocab_size), self.limits.cache_bytes)
            cache.get(params)
            self.cache_bytes = cache.size_bytes
            return
        timeout = self.limits.compile_timeout_s
        if not self._worker_lock.acquire(timeout=timeout):
            raise GrammarCompilerBusy(f"the grammar compiler is busy with another request for longer than "
                                      f"{timeout:g} s (--grammar-compile-timeout); retry")
        try:
            conn = self._worker()
            conn.send(dataclasses.asdict(params))
            if not conn.poll(timeout):
                self.compile_timeouts += 1
                self._stop_worker()
                raise ValueError(f"structured_outputs.{params.kind}: the grammar did not compile within {timeout:g} s "
                                 "(--grammar-compile-timeout); simplify it (fewer properties, shorter patterns)")
            try:
                error, self.cache_bytes = conn.recv()
            except (EOFError, OSError):
                self._stop_worker()
                raise ValueError(f"structured_outputs.{params.kind}: the grammar compiler process ended while "
                                 "compiling this constraint (out of memory?)") from None
        finally:
            self._worker_lock.release()
        if error is not None:
            raise ValueError(error)

    def _worker(self) -> Connection:
        """Our end of the pipe to the child, starting the child when there is none (under _worker_lock). The
        child is `python -m` this module: a spawned multiprocessing child would import the server's __main__
        first, and with it torch (300 MB instead of 100)."""
        if self._proc is not None and self._proc.poll() is None:
            return self._conn
        self._stop_worker()
        from vllm_neuron.structured_output.compiler import make_tokenizer_info

        info_json = make_tokenizer_info(self._tokenizer, self._vocab_size).serialize_json()
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                    stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        self._proc, self._conn = proc, conn
        conn.send((info_json, self.limits.cache_bytes))
        if not conn.poll(_START_TIMEOUT_S):
            self._stop_worker()
            raise RuntimeError(f"the grammar compiler process did not start within {_START_TIMEOUT_S:g} s")
        conn.recv()  # "ready"
        logger.info("Grammar compiler process started (pid %d, nice %d, cache %d bytes)", proc.pid, _COMPILE_NICE,
                    self.limits.cache_bytes)
        return conn

    def _stop_worker(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn = None, None
        self.cache_bytes = 0

    @property
    def worker_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def close(self) -> None:
        with self._worker_lock:
            self._stop_worker()


def _child_main(conn: Connection) -> None:
    """The compile process: one constraint at a time, (error or None, cache bytes) back. Its start-up (imports:
    xgrammar brings torch and transformers) runs at normal priority, so that the first grammar's request is not
    kept waiting behind busy cores; only the compilations run niced."""
    import xgrammar as xgr

    from vllm_neuron.structured_output.compiler import GrammarCache, new_compiler

    info_json, cache_bytes = conn.recv()
    cache = GrammarCache(new_compiler(xgr.TokenizerInfo.deserialize_json(info_json)), cache_bytes)
    del info_json
    os.nice(_COMPILE_NICE)
    conn.send("ready")
    while True:
        try:
            fields = conn.recv()
        except (EOFError, OSError):  # the API server is gone
            return
        t0 = time.perf_counter()
        try:
            cache.get(StructuredOutputsParams(**fields))
            error = None
        except ValueError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - any failure is this constraint's, reported to its request
            error = f"structured_outputs: the grammar failed to compile: {type(e).__name__}: {e}"
        logger.debug("grammar compiled in %.3f s (%s)", time.perf_counter() - t0, error or "ok")
        conn.send((error, cache.size_bytes))
        heap.trim()  # what the compilation freed goes back (milliseconds, after the answer)


if __name__ == "__main__":
    _child_main(Connection(int(sys.argv[1])))
