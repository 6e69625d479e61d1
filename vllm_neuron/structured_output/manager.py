"""The EngineCore's structured-output state: grammars compiled off the step loop, one matcher per request,
and the packed bitmask of the next token's allowed ids.

Compilation runs in a small thread pool (xgrammar compiles in native code) so that a slow schema never
stalls the decoding of other requests; the EngineCore keeps a request out of the scheduler until
`status` says its grammar is ready. Compiled grammars are shared by requests with the same text.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import xgrammar as xgr

from vllm_neuron.logger import init_logger
from vllm_neuron.structured_output.closing import ClosingPlan, TokenWriter
from vllm_neuron.structured_output.compiler import compile_params, make_tokenizer_info
from vllm_neuron.structured_output.params import StructuredOutputsParams

logger = init_logger(__name__)

# Distinct grammars kept compiled (an LRU; a JSON schema's compiled form is tens of KB).
_CACHE_SIZE = 256


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, max_workers: int = 2) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_info = make_tokenizer_info(tokenizer, vocab_size)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_workers, cache_enabled=True)
        self.num_words = -(-vocab_size // 32)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._grammars: OrderedDict[str, Future] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._buffers: dict[str, np.ndarray] = {}
        self._plans: dict[str, ClosingPlan] = {}
        self._writer: TokenWriter | None = None
        # After the grammar has accepted its stop token only a stop token may follow (ignore_eos).
        stop_only = np.zeros(self.num_words, np.uint32)
        for t in self.tokenizer_info.stop_token_ids:
            if 0 <= t < vocab_size:
                stop_only[t >> 5] |= np.uint32(1) << np.uint32(t & 31)
        self._stop_only = stop_only.view(np.int32)

    # -- compilation --------------------------------------------------------------------------------
    def submit(self, req_id: str, spec: Any) -> None:
        """Starts (or joins) the compilation of the request's grammar without blocking."""
        try:
            params = StructuredOutputsParams.from_value(spec)
            key = params.key()
        except ValueError as e:
            failed: Future = Future()
            failed.set_exception(e)
            self._pending[req_id] = failed
            return
        with self._lock:
            fut = self._grammars.get(key)
            if fut is None:
                fut = self._pool.submit(compile_params, self.compiler, params)
                self._grammars[key] = fut
                while len(self._grammars) > _CACHE_SIZE:
                    self._grammars.popitem(last=False)
            else:
                self._grammars.move_to_end(key)
        self._pending[req_id] = fut

    def status(self, req_id: str) -> tuple[bool, str | None]:
        """(ready, error): ready once the grammar is compiled and the request has its matcher."""
        if req_id in self._matchers:
            return True, None
        fut = self._pending.get(req_id)
        if fut is None:
            return False, f"no grammar was submitted for request {req_id}"
        if not fut.done():
            return False, None
        error = fut.exception()
        if error is not None:
            del self._pending[req_id]
            return False, str(error) or type(error).__name__
        del self._pending[req_id]
        matcher = xgr.GrammarMatcher(fut.result())
        self._matchers[req_id] = matcher
        self._buffers[req_id] = np.zeros(self.num_words, np.int32)
        if self._writer is None:
            info = self.tokenizer_info
            self._writer = TokenWriter(info.decoded_vocab, set(info.special_token_ids) | set(info.stop_token_ids))
        self._plans[req_id] = ClosingPlan(matcher, self._writer)
        return True, None

    def has(self, req_id: str) -> bool:
        return req_id in self._matchers

    # -- decoding -----------------------------------------------------------------------------------
    def bitmask(self, req_id: str, tokens_left: int | None = None) -> np.ndarray:
        """int32 [ceil(vocab_size / 32)]: bit t & 31 of word t >> 5 allows token t as the next token.
        `tokens_left` (this one included, before max_tokens or max_model_len): near the end only the
        grammar's shortest completion is allowed, so that the output closes (structured_output/closing.py)."""
        matcher = self._matchers[req_id]
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

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
