"""What the generation endpoints share: the checks that need the model (vocabulary, context length,
logprob caps), sampling parameters, blocking work moved off the event loop, logprob formatting, and
the life of a request in flight (metrics, abort on disconnect).

Field policy without the model is in request_policy.py, chat rendering in chat_template.py, SSE and
disconnect handling in streaming.py.
"""
from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from vllm_neuron import metrics
from vllm_neuron.config.kv_transfer import parse_kv_transfer_params
from vllm_neuron.engine.protocol import AdmissionTicket, EngineClient, EngineOverloadedError
from vllm_neuron.entrypoints.openai.chat_template import render_chat
from vllm_neuron.entrypoints.openai.errors import BadRequestError, InternalServerError, ServiceUnavailableError
from vllm_neuron.entrypoints.openai.http_edge import header_request_id, use_request_id
from vllm_neuron.entrypoints.openai.protocol import random_uuid
from vllm_neuron.entrypoints.openai.request_logger import RequestLogger
from vllm_neuron.entrypoints.openai.request_policy import RequestLimits, context_error, param_of_error
from vllm_neuron.entrypoints.openai.serving_models import OpenAIServingModels
from vllm_neuron.logger import init_logger
from vllm_neuron.outputs import CompletionOutput, Logprob, RequestOutput
from vllm_neuron.sampling_params import RequestOutputKind, SamplingParams
from vllm_neuron.structured_output.params import StructuredOutputsParams

logger = init_logger(__name__)

T = TypeVar("T")

# Template rendering and tokenization of one request run here, so that a heavy request (a looping
# template, a megabyte prompt) delays only itself: /health and running streams keep the event loop.
_BLOCKING_WORKERS = 2


class RequestTracker:
    """The engine requests of one HTTP request: metrics from the stream, abort of what is left
    unfinished when the HTTP request ends early (client gone, error, cancellation)."""

    def __init__(self, serving: OpenAIServing, arrival: float, ticket: AdmissionTicket | None = None) -> None:
        self._serving = serving
        self._arrival = arrival  # time.monotonic() when the HTTP request arrived
        self._ticket = ticket  # the request's admission, given back by close()
        self._timers: dict[str, metrics.RequestTimer | None] = {}
        self._reasons: dict[str, str] = {}

    def start(self, request_id: str, prompt_tokens: int) -> None:
        timer = metrics.RequestTimer(prompt_tokens, self._arrival) if self._serving.record_metrics else None
        self._timers[request_id] = timer

    def observe(self, res: RequestOutput) -> None:
        timer = self._timers.get(res.request_id)
        if timer is not None:
            timer.on_tokens(sum(len(o.token_ids) for o in res.outputs))
        for o in res.outputs:
            if o.finish_reason is not None:
                self._reasons[res.request_id] = o.finish_reason
        if res.finished and res.request_id in self._timers:
            timer = self._timers.pop(res.request_id)
            if timer is not None:
                timer.finish(self._reasons.pop(res.request_id, "stop"))

    def close(self, error: BaseException | None = None) -> None:
        """Aborts every unfinished request; safe to call from a finally during cancellation."""
        reason = "error" if error is not None and not isinstance(error, asyncio.CancelledError) else "abort"
        for request_id, timer in self._timers.items():
            self._serving.abort_soon(request_id)
            if timer is not None:
                timer.finish(reason)
        self._timers.clear()
        if self._ticket is not None:
            self._ticket.release()


class OpenAIServing:
    def __init__(self, engine: EngineClient, models: OpenAIServingModels, *, max_logprobs: int = 20,
                 chat_template: str | None = None, return_tokens_as_token_ids: bool = False,
                 record_metrics: bool = True, limits: RequestLimits | None = None,
                 blocking_pool: ThreadPoolExecutor | None = None, request_logger: RequestLogger | None = None) -> None:
        """blocking_pool: where template rendering and tokenization run (shared by the routes of one
        app; a private pool of its own when not given). request_logger: --enable-log-requests' lines."""
        self.engine = engine
        self.request_logger = request_logger
        self.models = models
        self.max_logprobs = max_logprobs
        self.chat_template = chat_template
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.record_metrics = record_metrics
        self.limits = limits or RequestLimits()
        self._pool = blocking_pool or ThreadPoolExecutor(_BLOCKING_WORKERS, thread_name_prefix="vllm-neuron-render")
        self._background: set[asyncio.Task] = set()
        self._max_prompt_chars: int | None = None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.model_info.max_model_len

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    # ---- checks ---------------------------------------------------------------------------------

    def check_engine(self) -> None:
        if self.engine.errored:
            raise InternalServerError("The engine is dead; the server cannot serve requests.")
        if not self.engine.is_ready:
            raise ServiceUnavailableError("The server is not ready yet: warm-up and compilation are in progress.")

    def check_logprobs_cap(self, value: int | None, param: str) -> None:
        if value is None:
            return
        if value < -1:
            raise BadRequestError(f"`{param}` must be a positive value or -1.", param=param)
        wanted = self.vocab_size if value == -1 else value
        cap = self.vocab_size if self.max_logprobs == -1 else self.max_logprobs
        if wanted > cap:
            kind = "prompt" if param == "prompt_logprobs" else "sample"
            raise BadRequestError(f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: "
                                  f"{cap}", param=param)

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise BadRequestError(f"Token id(s) {bad[:10]} in `{param}` are outside the vocabulary "
                                  f"(size {self.vocab_size}).", param=param)

    def resolve_max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        """max_tokens for the engine: the remaining context when not given (at most the generation
        config's max_new_tokens); 400 when the prompt
        (plus the requested completion) does not fit in max_model_len."""
        if requested is not None and requested < 1:
            raise BadRequestError(f"{param} must be at least 1, got {requested}.", param=param)
        if requested is None:
            if prompt_len >= self.max_model_len:
                raise BadRequestError(context_error(self.max_model_len, prompt_len, None), param="messages")
            # vLLM's rule: the rest of the context, capped by the generation config's max_new_tokens.
            return min(self.max_model_len - prompt_len, self.sampling_defaults.get("max_tokens", self.max_model_len))
        if prompt_len + requested > self.max_model_len:
            raise BadRequestError(context_error(self.max_model_len, prompt_len, requested), param=param)
        return requested

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        return getattr(self.engine.model_info, "sampling_defaults", None) or {}

    def _default(self, value: Any, name: str, neutral: Any) -> Any:
        """A request field left unset takes the generation config's default, else vLLM's neutral one."""
        return value if value is not None else self.sampling_defaults.get(name, neutral)

    def build_sampling_params(self, req: Any, *, max_tokens: int, logprobs: int | None,
                              structured_outputs: StructuredOutputsParams | None = None,
                              prompt_logprobs: int | None = None) -> SamplingParams:
        self.check_token_ids(list(req.stop_token_ids or []), "stop_token_ids")
        self.check_token_ids(list(req.allowed_token_ids or []), "allowed_token_ids")
        logit_bias = None
        if req.logit_bias:
            try:
                logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
            except (TypeError, ValueError):
                raise BadRequestError("logit_bias keys must be token ids (integers as strings).",
                                      param="logit_bias") from None
            if not all(math.isfinite(v) for v in logit_bias.values()):
                raise BadRequestError("logit_bias values must be finite numbers.", param="logit_bias")
            logit_bias = {k: max(-100.0, min(100.0, v)) for k, v in logit_bias.items()}
            self.check_token_ids(list(logit_bias), "logit_bias")
        extra_args = None
        if req.kv_transfer_params is not None:
            try:
                ktp = parse_kv_transfer_params(req.kv_transfer_params)
            except ValueError as e:
                raise BadRequestError(str(e), param="kv_transfer_params") from None
            if ktp.get("do_remote_decode") and req.stream:
                raise BadRequestError("kv_transfer_params with do_remote_decode needs stream: false (the response "
                                      "carries the kv_transfer_params for the decode instance)", param="stream")
            extra_args = {"kv_transfer_params": ktp}
        try:
            sp = SamplingParams(
                extra_args=extra_args,
                n=req.n if req.n is not None else 1,
                presence_penalty=req.presence_penalty if req.presence_penalty is not None else 0.0,
                frequency_penalty=req.frequency_penalty if req.frequency_penalty is not None else 0.0,
                repetition_penalty=self._default(req.repetition_penalty, "repetition_penalty", 1.0),
                temperature=self._default(req.temperature, "temperature", 1.0),
                top_p=self._default(req.top_p, "top_p", 1.0),
                top_k=self._default(req.top_k, "top_k", 0),
                min_p=self._default(req.min_p, "min_p", 0.0),
                seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                bad_words=req.bad_words or None,
                include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
                max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens, logit_bias=logit_bias,
                allowed_token_ids=req.allowed_token_ids, structured_outputs=structured_outputs,
                # DELTA even for non-streaming requests: the server sees every token arrive (metrics,
                # disconnect checks) and assembles the final text itself.
                output_kind=RequestOutputKind.DELTA)
            sp.verify(self.vocab_size, None if self.max_logprobs == -1 else self.max_logprobs)
        except ValueError as e:
            raise BadRequestError(str(e), param=param_of_error(str(e))) from None
        return sp

    # ---- admission and grammars ----------------------------------------------------------------

    async def admitted(self, weight: int, work: Callable[[AdmissionTicket], Awaitable[T]]) -> T:
        """`work(ticket)` with room for `weight` engine requests reserved first (a 503 with Retry-After when
        the server is saturated). The ticket goes back when work fails, else when the request's generation
        ends (RequestTracker.close), for a stream after its last chunk."""
        try:
            ticket = self.engine.admit(weight)
        except EngineOverloadedError as e:
            raise ServiceUnavailableError(str(e), headers={"Retry-After": str(e.retry_after_s)}) from None
        except ValueError as e:
            raise BadRequestError(str(e), param="n") from None
        try:
            return await work(ticket)
        except BaseException:
            ticket.release()
            raise

    async def check_structured_outputs(self, params: StructuredOutputsParams, param: str | None,
                                       max_tokens: int | None) -> None:
        """The constraint's size limits and compilation (off the event loop; remembered once compiled): a 400
        naming the problem, a 503 while the grammar compiler is busy with another request."""
        try:
            # Not in the render pool: a check may wait seconds for the compile process, and rendering must not.
            await asyncio.to_thread(self.engine.check_structured_outputs, params, max_tokens)
        except ValueError as e:
            raise BadRequestError(str(e), param=param) from None
        except EngineOverloadedError as e:
            raise ServiceUnavailableError(str(e), headers={"Retry-After": str(e.retry_after_s)}) from None

    # ---- blocking work, off the event loop ------------------------------------------------------

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    async def encode(self, text: str, add_special_tokens: bool, bounded: bool = True,
                     param: str = "messages") -> list[int]:
        """Token ids of `text`. `bounded`: a text longer than max_model_len tokens of the vocabulary's longest
        can hold is refused before tokenizing (tokenizing 7 MB costs ~500 MB, for a 400 all the same); a request
        that truncates its prompt (truncate_prompt_tokens), and /tokenize, tokenize text of any length."""
        if bounded and len(text) > self.max_prompt_chars:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt is "
                f"{len(text)} characters long, more than {self.max_model_len} tokens hold (at most "
                f"{self.max_prompt_chars} characters). Please reduce the length of the messages.", param=param)
        return await self.run_blocking(lambda: list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens)))

    @property
    def max_prompt_chars(self) -> int:
        """Characters max_model_len tokens can cover at most: max_model_len x the longest vocabulary entry, x 4
        when the tokenizer normalizes its input (Unicode composition may merge several characters into one)."""
        if self._max_prompt_chars is None:
            longest = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            normalizes = backend is None or backend.normalizer is not None
            self._max_prompt_chars = self.max_model_len * max(longest, 1) * (4 if normalizes else 1)
        return self._max_prompt_chars

    async def render_chat(self, messages: list[Any], *, request_template: str | None, **kwargs: Any) -> str:
        """The prompt text of a conversation; a request's own template only with
        --trust-request-chat-template."""
        self.limits.check_chat_template(request_template)
        template = request_template or self.chat_template
        return await self.run_blocking(render_chat, self.tokenizer, messages, template=template, **kwargs)

    # ---- requests in flight ---------------------------------------------------------------------

    @staticmethod
    def base_request_id(raw_request: Any, body_request_id: str | None) -> str:
        """vLLM's rule: the X-Request-Id header, else the body's `request_id`, else a new id; the response echoes it."""
        rid = header_request_id(raw_request.scope) or body_request_id or random_uuid()
        use_request_id(raw_request.scope, rid)
        return rid

    def abort_soon(self, request_id: str) -> None:
        """Aborts in a task of its own: callable from a finally of a cancelled task, where awaiting
        would be interrupted again."""
        async def _abort() -> None:
            try:
                await self.engine.abort(request_id)
            except Exception:  # the request is gone either way; do not mask the original error
                logger.warning("engine.abort(%s) failed", request_id, exc_info=True)
        task = asyncio.get_running_loop().create_task(_abort())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def generate(self, tracker: RequestTracker, prompt: Any, sp: SamplingParams, request_id: str,
                       prompt_tokens: int, priority: int = 0, lora_request: Any = None) -> AsyncIterator[RequestOutput]:
        tracker.start(request_id, prompt_tokens)
        log = self.request_logger
        if log is not None:
            log.log_inputs(request_id, prompt, sp, priority)
        try:
            lora = {"lora_request": lora_request} if lora_request is not None else {}
            async for res in self.engine.generate(prompt, sp, request_id, priority, **lora):
                tracker.observe(res)
                if log is not None:
                    log.observe(res)
                yield res
        except ValueError as e:
            # The engine refuses a request it cannot take (documented in EngineClient.generate).
            raise BadRequestError(str(e), param="priority" if "priority" in str(e) else None) from e
        except EngineOverloadedError as e:
            raise ServiceUnavailableError(str(e), headers={"Retry-After": str(e.retry_after_s)}) from e
        finally:
            if log is not None:
                log.forget(request_id)

    # ---- logprobs -------------------------------------------------------------------------------

    def token_str(self, token_id: int, lp: Logprob | None, as_ids: bool) -> str:
        if as_ids or self.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id])

    @staticmethod
    def top_entries(step: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
        """The `num` most likely entries of one step, by rank (then logprob)."""
        if num <= 0:
            return []
        ranked = sorted(step.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                      -kv[1].logprob))
        return ranked[:num]

    @staticmethod
    def clamp(logprob: float) -> float:
        return max(logprob, -9999.0)

    def prompt_logprobs_json(self, plp: list[dict[int, Logprob] | None] | None) -> list[dict[str, dict] | None] | None:
        """vLLM's `prompt_logprobs` response field: per prompt token None (the first) or token id -> Logprob."""
        if plp is None:
            return None
        return [None if step is None else
                {str(t): {"logprob": self.clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
                 for t, lp in step.items()} for step in plp]


@dataclass
class ChoiceAccumulator:
    """One choice assembled from DELTA outputs."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, o: CompletionOutput) -> None:
        self.text.append(o.text)
        self.token_ids.extend(o.token_ids)
        if o.logprobs:
            self.logprobs.extend(o.logprobs)
        if o.finish_reason is not None:
            self.finish_reason, self.stop_reason = o.finish_reason, o.stop_reason



