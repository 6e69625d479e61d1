"""EngineCoreOutputs in, vLLM-shaped RequestOutputs out: detokenization, stop strings, logprobs,
the n completions of one request gathered under their parent id, and request timing."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron import profiler
from vllm_neuron.engine.detokenizer import IncrementalDetokenizer
from vllm_neuron.engine.messages import EngineCoreOutput, EngineCoreRequest
from vllm_neuron.outputs import (CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestMetrics,
                                 RequestOutput)
from vllm_neuron.pooling_params import PoolingParams
from vllm_neuron.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class _Completion:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # for DELTA outputs
    changed: bool = False


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: dict[str, _Completion]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None  # a prefill instance's answer for the decode instance
    prompt_logprobs: list | None = None  # PromptLogprobs once the engine sent them
    prompt_logprobs_sent: bool = False  # DELTA outputs carry them once

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions.values())


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        # Pooling requests (one engine request each, the same id): (prompt, prompt ids, metrics).
        self.pooling: dict[str, tuple[str | None, list[int], RequestMetrics]] = {}
        self.parent_of: dict[str, str] = {}  # engine request id -> user request id
        # Timing observations for metrics, drained by the caller: (kind, seconds).
        self.latency_events: list[tuple[str, float]] = []

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams, core_reqs: list[EngineCoreRequest]) -> None:
        if request_id in self.requests or request_id in self.pooling:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(params, PoolingParams):
            self.pooling[request_id] = (prompt, prompt_token_ids, RequestMetrics(arrival_time=time.time()))
            self.parent_of[core_reqs[0].request_id] = request_id
            return
        comps = {}
        for i, r in enumerate(core_reqs):
            comps[r.request_id] = _Completion(i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                                        r.sampling_params),
                                              logprobs=[] if params.logprobs is not None else None,
                                              cumulative_logprob=0.0 if params.logprobs is not None else None)
            self.parent_of[r.request_id] = request_id
        self.requests[request_id] = _RequestState(request_id, prompt, prompt_token_ids, params, comps,
                                                  RequestMetrics(arrival_time=time.time()))

    def engine_ids(self, request_id: str) -> list[str]:
        if request_id in self.pooling:
            return [cid for cid, parent in self.parent_of.items() if parent == request_id]
        st = self.requests.get(request_id)
        return [] if st is None else [cid for cid, c in st.completions.items() if c.finish_reason is None]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Marks a request aborted; returns its final output (None for a pooling request: it has none)."""
        if self.pooling.pop(request_id, None) is not None:
            for cid in [c for c, parent in self.parent_of.items() if parent == request_id]:
                del self.parent_of[cid]
            return None
        st = self.requests.get(request_id)
        if st is None:
            return None
        for c in st.completions.values():
            if c.finish_reason is None:
                c.finish_reason, c.changed = "abort", True
        return self._finish(st)

    @profiler.ranged("detokenize")
    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the RequestOutputs to emit and the engine request ids to abort (stop strings)."""
        touched: dict[str, _RequestState] = {}
        results: list = []
        to_abort = []
        now = time.time()
        for out in outputs:
            parent = self.parent_of.get(out.request_id)
            if parent in self.pooling:
                if out.finished:
                    results.append(self._finish_pooling(out.request_id, parent, out, now))
                continue
            st = self.requests.get(parent) if parent else None
            if st is None:
                continue
            c = st.completions[out.request_id]
            if c.finish_reason is not None:
                continue
            self._record_timing(st, now, len(out.new_token_ids))
            st.num_cached_tokens = max(st.num_cached_tokens, out.num_cached_tokens)
            if out.kv_transfer_params is not None:
                st.kv_transfer_params = out.kv_transfer_params
            c.token_ids.extend(out.new_token_ids)
            if out.prompt_logprobs is not None and st.prompt_logprobs is None:
                st.prompt_logprobs = [None] + self._logprob_dicts(out.prompt_logprobs)
            if out.new_logprobs is not None and c.logprobs is not None:
                for entries in out.new_logprobs:
                    c.logprobs.append(self._logprob_dict(entries))
                    c.cumulative_logprob += entries[0][1]
            stop_terminated = out.finish_reason == "stop" and not isinstance(out.stop_reason, str)
            stop_str = c.detok.update(out.new_token_ids, stop_terminated=stop_terminated)
            if stop_str is not None and out.finish_reason is None:
                c.finish_reason, c.stop_reason = "stop", stop_str
                to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                c.finish_reason, c.stop_reason = out.finish_reason, stop_str or out.stop_reason
            c.changed = True
            touched[st.request_id] = st
        for st in touched.values():
            if st.finished:
                results.append(self._finish(st))
            elif st.params.output_kind != RequestOutputKind.FINAL_ONLY:
                results.append(self._make_output(st, finished=False))
        return results, to_abort

    def _finish_pooling(self, engine_id: str, request_id: str, out: EngineCoreOutput, now: float) -> PoolingRequestOutput:
        prompt, ids, m = self.pooling.pop(request_id)
        del self.parent_of[engine_id]
        m.first_token_time = m.last_token_time = m.finished_time = now
        self.latency_events.append(("e2e", now - m.arrival_time))
        if out.pooled is None:
            raise RuntimeError(f"pooling request {request_id} finished ({out.finish_reason}) without an output")
        return PoolingRequestOutput(request_id, PoolingOutput(out.pooled), ids, True, prompt, m)

    def _record_timing(self, st: _RequestState, now: float, n: int) -> None:
        m = st.metrics
        if m.first_token_time is None:
            m.first_token_time = now
            self.latency_events.append(("ttft", now - m.arrival_time))
        elif m.last_token_time is not None and n:
            self.latency_events.append(("itl", (now - m.last_token_time) / n))
        m.last_token_time = now

    def _logprob_dict(self, entries: list[tuple[int, float, int]]) -> dict[int, Logprob]:
        d: dict[int, Logprob] = {}
        for tok, lp, rank in entries:
            if tok not in d:
                d[tok] = Logprob(lp, rank, self.tokenizer.decode([tok]))
        return d

    def _logprob_dicts(self, positions: list[list[tuple[int, float, int]]]) -> list[dict[int, Logprob]]:
        """Many positions at once: each distinct token decoded once (a scored prompt has hundreds)."""
        ids = sorted({tok for entries in positions for tok, _, _ in entries})
        text = dict(zip(ids, self.tokenizer.batch_decode([[t] for t in ids])))
        out = []
        for entries in positions:
            d: dict[int, Logprob] = {}
            for tok, lp, rank in entries:
                if tok not in d:
                    d[tok] = Logprob(lp, rank, text[tok])
            out.append(d)
        return out

    def _finish(self, st: _RequestState) -> RequestOutput:
        st.metrics.finished_time = time.time()
        self.latency_events.append(("e2e", st.metrics.finished_time - st.metrics.arrival_time))
        del self.requests[st.request_id]
        for cid in st.completions:
            self.parent_of.pop(cid, None)
        return self._make_output(st, finished=True)

    def _make_output(self, st: _RequestState, finished: bool) -> RequestOutput:
        delta = st.params.output_kind == RequestOutputKind.DELTA
        comps = []
        for c in sorted(st.completions.values(), key=lambda c: c.index):
            if delta and not c.changed:
                continue
            done = c.finish_reason is not None
            if delta:
                text, ids = c.detok.get_delta_text(done), c.token_ids[c.sent_tokens:]
                lps = c.logprobs[c.sent_tokens:] if c.logprobs is not None else None
                c.sent_tokens = len(c.token_ids)
            else:
                text, ids, lps = c.detok.get_cumulative_text(done), list(c.token_ids), c.logprobs
            c.changed = False
            comps.append(CompletionOutput(c.index, text, ids, c.cumulative_logprob,
                                          list(lps) if lps is not None else None, c.finish_reason, c.stop_reason))
        prompt_logprobs = st.prompt_logprobs
        if delta and st.prompt_logprobs_sent:
            prompt_logprobs = None
        st.prompt_logprobs_sent = st.prompt_logprobs_sent or prompt_logprobs is not None
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, prompt_logprobs, comps, finished,
                             st.metrics, st.num_cached_tokens, st.kv_transfer_params if finished else None)

