"""The EngineCore's structured-output state: grammars compiled off the step loop, one matcher per request,
and the packed bitmask of the next token's allowed ids.

Compilation runs in a small thread pool (xgrammar compiles in native code and releases the GIL) whose
threads run at low priority (nice 10, inherited by xgrammar's own compile threads), so that a slow schema
never stalls the decoding of other requests; the EngineCore keeps a request out of the scheduler until
`status` says its grammar is ready. A compilation running longer than `compile_timeout_s` fails its
requests (the client's 400); its thread cannot be interrupted and finishes unseen.
Compiled grammars are shared by requests with the same text while they compile, and afterwards through
a GrammarCache bounded in bytes (`cache_bytes`).
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xgrammar as xgr

from vllm_neuron.config.grammar_limits import DEFAULT_CACHE_BYTES, DEFAULT_COMPILE_TIMEOUT_S
from vllm_neuron.logger import init_logger
from vllm_neuron.structured_output import GRAMMAR_BUSY, GRAMMAR_INVALID
from vllm_neuron.structured_output.closing import ClosingPlan, TokenWriter
from vllm_neuron.structured_output.compiler import GrammarCache, make_tokenizer_info, new_compiler
from vllm_neuron.structured_output.params import StructuredOutputsParams

logger = init_logger(__name__)

_COMPILE_NICE = 10


# A compilation queued behind others this many time limits long gives up (the threads are held by
# compilations past their limit, which cannot be interrupted).
_QUEUE_LIMITS = 3


def _lower_priority() -> None:
    """This thread at nice 10: the step threads get the cores first (Linux: per-thread nice values)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _COMPILE_NICE)
    except (AttributeError, OSError):  # not Linux: compile at the process' priority
        pass


@dataclass
class _Compilation:
    future: Future
    started: float | None = None  # time.monotonic() when it began running (not while it queued)
    submitted: float = field(default_factory=time.monotonic)


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, max_workers: int = 2,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.vocab_size = vocab_size
        self.compile_timeout_s = compile_timeout_s
        self.tokenizer_info = make_tokenizer_info(tokenizer, vocab_size)
        self.grammars = GrammarCache(new_compiler(self.tokenizer_info, max_threads=max_workers), cache_bytes)
        self.num_words = -(-vocab_size // 32)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile",
                                        initializer=_lower_priority)
        self._lock = threading.RLock()
        self._compiling: dict[str, _Compilation] = {}  # grammar key -> its compilation, while it runs
        self._pending: dict[str, _Compilation] = {}  # request id -> the compilation it waits for
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._buffers: dict[str, np.ndarray] = {}
        self._plans: dict[str, ClosingPlan] = {}
        # request id -> (the tokens that end its reasoning, the last tokens seen): until they are sampled, every
        # token is allowed
        self._gates: dict[str, tuple[tuple[int, ...], list[int]]] = {}
        self._writer: TokenWriter | None = None
        self.compile_timeouts = 0
        # After the grammar has accepted its stop token only a stop token may follow (ignore_eos).
        stop_only = np.zeros(self.num_words, np.uint32)
        for t in self.tokenizer_info.stop_token_ids:
            if 0 <= t < vocab_size:
                stop_only[t >> 5] |= np.uint32(1) << np.uint32(t & 31)
        self._stop_only = stop_only.view(np.int32)

    @property
    def cache_bytes(self) -> int:
        """Bytes of compiled grammars kept for reuse."""
        return self.grammars.size_bytes

    # -- compilation --------------------------------------------------------------------------------
    def submit(self, req_id: str, spec: Any) -> None:
        """Starts (or joins) the compilation of the request's grammar without blocking."""
        try:
            params = StructuredOutputsParams.from_value(spec)
            key = params.key()
        except ValueError as e:
            failed: Future = Future()
            failed.set_exception(e)
            self._pending[req_id] = _Compilation(failed)
            return
        if params._reasoning_end:
            self._gates[req_id] = (tuple(params._reasoning_end), [])
        with self._lock:
            comp = self._compiling.get(key)
            if comp is None:
                comp = self._start(key, params)
        self._pending[req_id] = comp

    def _start(self, key: str, params: StructuredOutputsParams) -> _Compilation:
        """(under self._lock)"""
        comp = _Compilation(Future())

        def run() -> xgr.CompiledGrammar:
            comp.started = time.monotonic()
            return self.grammars.get(params)

        comp.future = self._pool.submit(run)
        self._compiling[key] = comp
        # Runs at once, in this thread, when the compilation is done already: hence the RLock.
        comp.future.add_done_callback(lambda _f: self._compiled(key, comp))
        return comp

    def _compiled(self, key: str, comp: _Compilation) -> None:
        with self._lock:
            if self._compiling.get(key) is comp:
                del self._compiling[key]

    def status(self, req_id: str) -> tuple[bool, str | None, str | None]:
        """(ready, error, error kind): ready once the grammar is compiled and the request has its matcher; an
        error fails the request (kinds: GRAMMAR_INVALID, GRAMMAR_BUSY, or None for an unexpected fault)."""
        if req_id in self._matchers:
            return True, None, None
        comp = self._pending.get(req_id)
        if comp is None:
            return False, f"no grammar was submitted for request {req_id}", None
        fut = comp.future
        if not fut.done():
            now, limit = time.monotonic(), self.compile_timeout_s
            if comp.started is not None and now - comp.started > limit:
                del self._pending[req_id]
                self.compile_timeouts += 1
                return False, (f"structured_outputs: the grammar did not compile within {limit:g} s "
                               "(--grammar-compile-timeout); simplify it (fewer properties, shorter patterns)"), \
                    GRAMMAR_INVALID
            if comp.started is None and now - comp.submitted > _QUEUE_LIMITS * limit:
                del self._pending[req_id]
                return False, (f"the grammar compiler is busy with other requests' grammars (waited "
                               f"{now - comp.submitted:.0f} s); retry"), GRAMMAR_BUSY
            return False, None, None
        error = fut.exception()
        if error is not None:
            del self._pending[req_id]
            return False, str(error) or type(error).__name__, GRAMMAR_INVALID if isinstance(error, ValueError) else None
        del self._pending[req_id]
        matcher = xgr.GrammarMatcher(fut.result())
        self._matchers[req_id] = matcher
        self._buffers[req_id] = np.zeros(self.num_words, np.int32)
        if self._writer is None:
            info = self.tokenizer_info
            self._writer = TokenWriter(info.decoded_vocab, set(info.special_token_ids) | set(info.stop_token_ids))
        self._plans[req_id] = ClosingPlan(matcher, self._writer)
        return True, None, None

    def wait_any(self, req_ids: Iterable[str], timeout_s: float) -> None:
        """Blocks until one of these requests' grammars has compiled or failed, at most `timeout_s`."""
        futures = [c.future for r in req_ids if (c := self._pending.get(r)) is not None]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def has(self, req_id: str) -> bool:
        return req_id in self._matchers

    # -- decoding -----------------------------------------------------------------------------------
    def bitmask(self, req_id: str, tokens_left: int | None = None) -> np.ndarray:
        """int32 [ceil(vocab_size / 32)]: bit t & 31 of word t >> 5 allows token t as the next token.
        `tokens_left` (this one included, before max_tokens or max_model_len): near the end only the
        grammar's shortest completion is allowed, so that the output closes (structured_output/closing.py)."""
        matcher = self._matchers[req_id]
        if req_id in self._gates:
            return np.full(self.num_words, -1, np.int32)  # still reasoning: not constrained yet
        if matcher.is_terminated():
            return self._stop_only.copy()
        buf = self._buffers[req_id]
        matcher.fill_next_token_bitmask(buf)
        forced = self._plans[req_id].forced_token(matcher, tokens_left) if tokens_left is not None else None
        if forced == -1 and (buf & self._stop_only).any():
            return self._stop_only.copy()
        if forced is not None and forced >= 0 and (int(buf[forced >> 5]) >> (forced & 31)) & 1:
            only = np.zeros(self.num_words, np.uint32)
            only[forced >> 5] = np.uint32(1) << np.uint32(forced & 31)
            return only.view(np.int32)
        return buf.copy()

    def bitmasks(self, req_id: str, drafts: list[int], tokens_left: int | None = None) -> np.ndarray:
        """int32 [1 + len(drafts), words]: the masks of a verification's positions. The matcher walks
        through the drafts (row i + 1 is the mask after drafts[:i + 1]) and is rolled back after, so the
        tokens the step emits are accepted as usual. Rows past a draft the grammar refuses are never
        reached (the row before rejects that draft) and allow everything. `tokens_left` as `bitmask`'s, for
        the first position."""
        matcher = self._matchers[req_id]
        out = np.full((1 + len(drafts), self.num_words), -1, np.int32)
        if req_id in self._gates:
            return out  # still reasoning (a draft that ends it is checked from the next step on)
        walked = 0
        for i in range(len(drafts) + 1):
            out[i] = self.bitmask(req_id, None if tokens_left is None else tokens_left - i)
            if i == len(drafts):
                break
            if matcher.is_terminated():
                continue  # past the grammar's end only stop tokens follow (bitmask says so)
            if not matcher.accept_token(drafts[i]):
                break
            walked += 1
        if walked:
            matcher.rollback(walked)
        return out

    def accept(self, req_id: str, token_ids: list[int]) -> None:
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return
        gate = self._gates.get(req_id)
        if gate is not None:
            end, seen = gate
            seen = seen + list(token_ids)
            at = next((i for i in range(len(seen) - len(end) + 1) if tuple(seen[i:i + len(end)]) == end), None)
            if at is None:
                self._gates[req_id] = (end, seen[-(len(end) - 1):] if len(end) > 1 else [])
                return
            del self._gates[req_id]
            token_ids = seen[at + len(end):]
        for t in token_ids:
            if matcher.is_terminated():
                return  # tokens after the grammar's end (ignore_eos) change nothing
            if not matcher.accept_token(t):
                # Only a sampler that ignored the mask gets here; the matcher stays where it was.
                logger.error("request %s: token %d is not allowed by its grammar", req_id, t)
                return

    def remove(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._matchers.pop(req_id, None)
        self._buffers.pop(req_id, None)
        self._plans.pop(req_id, None)
        self._gates.pop(req_id, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
