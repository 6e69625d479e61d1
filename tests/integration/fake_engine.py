"""A deterministic fake `EngineClient` for HTTP-layer tests: no model, real tokenizer.

Choice j of a request generates the token ids of SCRIPT (cyclically) starting at position
`(seed or 0) + 5 * j`, so tests can compute the expected text with `expected_ids`. It honours
max_tokens, stop strings (with include_stop_str_in_output), stop_token_ids, logprobs, n and the
three output kinds, and records every request and abort.

Markers in the decoded prompt trigger behaviours:
  [[slow]]     0.05 s between tokens (for disconnect tests)
  [[invalid]]  ValueError before the first output (the engine refuses the request)
  [[dead]]     EngineDeadError before the first output
  [[dead-mid]] EngineDeadError after two outputs
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron import metrics
from vllm_neuron.engine.protocol import EngineClient, EngineDeadError, ModelInfo, PromptType
from vllm_neuron.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_neuron.sampling_params import RequestOutputKind, SamplingParams

@contextlib.contextmanager
def serve_app(app: Any, **uvicorn_kwargs: Any) -> Iterator[int]:
    """`app` served by create_server (uvicorn with the HTTP edge) in a thread on 127.0.0.1; yields the port."""
    from vllm_neuron.entrypoints.openai.api_server import create_server

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = create_server(app, "127.0.0.1", sock.getsockname()[1], timeout_graceful_shutdown=1, **uvicorn_kwargs)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()


SCRIPT = " The quick brown fox jumps over the lazy dog. A stitch in time saves nine."


@dataclass
class Call:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str | None
    params: SamplingParams
    priority: int = 0
    cancelled: bool = False
    finished: bool = False
    outputs_sent: int = 0


@dataclass
class FakeEngine(EngineClient):
    tokenizer: Any
    max_model_len: int = 256
    ready: bool = True
    dead: bool = False
    warmed_up: tuple[int, int] | None = None  # what the engine reports of its warm-up
    token_delay: float = 0.0
    calls: dict[str, Call] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model_info = ModelInfo(model_path="/models/SmolLM2-135M-Instruct.Q4_1.gguf",
                                    max_model_len=self.max_model_len, eos_token_id=self.tokenizer.eos_token_id)
        self.script_ids = self.tokenizer.encode(SCRIPT, add_special_tokens=False)

    # ---- EngineClient ----
    @property
    def warmup_progress(self) -> tuple[int, int] | None:
        return self.warmed_up

    @property
    def is_ready(self) -> bool:
        return self.ready and not self.dead

    @property
    def errored(self) -> bool:
        return self.dead

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDeadError("fake engine died")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def expected_ids(self, n_tokens: int, seed: int | None = None, index: int = 0) -> list[int]:
        start = (seed or 0) + 5 * index
        return [self.script_ids[(start + k) % len(self.script_ids)] for k in range(n_tokens)]

    def logprob_of(self, step: int, rank: int) -> float:
        return -0.25 * (step % 4) - 0.5 * (rank - 1) - 0.01

    def _step_logprobs(self, tid: int, step: int, num: int) -> dict[int, Logprob]:
        vocab = len(self.tokenizer)
        out = {tid: Logprob(self.logprob_of(step, 1), 1, self.tokenizer.decode([tid]))}
        for r in range(2, num + 1):
            alt = (tid + 7 * r) % vocab
            out[alt] = Logprob(self.logprob_of(step, r), r, self.tokenizer.decode([alt]))
        return out

    def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                 priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        return self._generate(prompt, sampling_params, request_id, priority)

    async def _generate(self, prompt: PromptType, sp: SamplingParams, request_id: str, priority: int = 0):
        if isinstance(prompt, str):
            ids, text = self.tokenizer.encode(prompt), prompt
        elif isinstance(prompt, list):
            ids, text = list(prompt), None
        elif "prompt_token_ids" in prompt:
            ids, text = list(prompt["prompt_token_ids"]), prompt.get("prompt")
        else:
            ids, text = self.tokenizer.encode(prompt["prompt"]), prompt["prompt"]
        call = self.calls[request_id] = Call(request_id, ids, text, sp, priority)
        decoded = self.tokenizer.decode(ids)
        if "[[invalid]]" in decoded:
            raise ValueError("the fake engine refuses this prompt")
        if "[[dead]]" in decoded or self.dead:
            raise EngineDeadError("fake engine died")
        delay = 0.05 if "[[slow]]" in decoded else self.token_delay
        max_tokens = sp.max_tokens or (self.max_model_len - len(ids))
        n = sp.n
        gen_ids: list[list[int]] = [[] for _ in range(n)]
        texts = [""] * n
        sent_tokens, sent_text, sent_lps = [0] * n, [0] * n, [0] * n
        lps: list[list[dict[int, Logprob]]] = [[] for _ in range(n)]
        finish: list[tuple[str, Any] | None] = [None] * n
        reported = [False] * n
        metrics.record_step(num_running=1, num_waiting=0, kv_cache_usage=len(ids) / self.max_model_len,
                            prefix_cache_queries=len(ids), prefix_cache_hits=0)
        metrics.record_padding("tokens", "prefill_s256", 256 - len(ids))
        metrics.record_execution("prefill_s256")
        try:
            step = 0
            while any(f is None for f in finish):
                if delay:
                    await asyncio.sleep(delay)
                else:
                    await asyncio.sleep(0)
                if self.dead or ("[[dead-mid]]" in decoded and step == 2):
                    raise EngineDeadError("fake engine died mid-request")
                for j in range(n):
                    if finish[j] is not None:
                        continue
                    tid = self.expected_ids(step + 1, sp.seed, j)[-1]
                    gen_ids[j].append(tid)
                    if sp.logprobs is not None:
                        lps[j].append(self._step_logprobs(tid, step, sp.logprobs))
                    if tid in sp.stop_token_ids:
                        finish[j] = ("stop", tid)
                        continue
                    texts[j] = self.tokenizer.decode(gen_ids[j])
                    for s in sp.stop:
                        pos = texts[j].find(s)
                        if pos != -1:
                            texts[j] = texts[j][:pos + (len(s) if sp.include_stop_str_in_output else 0)]
                            finish[j] = ("stop", s)
                            break
                    if finish[j] is None and len(gen_ids[j]) >= max_tokens:
                        finish[j] = ("length", None)
                metrics.record_padding("seqs", "decode_b4", 4 - n)
                metrics.record_execution("decode_b4")
                step += 1
                done = all(f is not None for f in finish)
                if sp.output_kind == RequestOutputKind.FINAL_ONLY and not done:
                    continue
                outs = []
                delta = sp.output_kind == RequestOutputKind.DELTA
                for j in range(n):
                    if delta and reported[j]:
                        continue  # like vLLM, a finished choice is not repeated in DELTA mode
                    reported[j] = finish[j] is not None
                    t0, c0, l0 = (sent_tokens[j], sent_text[j], sent_lps[j]) if delta else (0, 0, 0)
                    outs.append(CompletionOutput(
                        index=j, text=texts[j][c0:], token_ids=gen_ids[j][t0:],
                        logprobs=lps[j][l0:] if sp.logprobs is not None else None,
                        finish_reason=finish[j][0] if finish[j] else None,
                        stop_reason=finish[j][1] if finish[j] else None))
                    sent_tokens[j], sent_text[j], sent_lps[j] = len(gen_ids[j]), len(texts[j]), len(lps[j])
                yield RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=ids,
                                    prompt_logprobs=None,
                                    outputs=outs, finished=done, num_cached_tokens=0)
                call.outputs_sent += 1
            call.finished = True
        except (asyncio.CancelledError, GeneratorExit):
            call.cancelled = True
            raise
