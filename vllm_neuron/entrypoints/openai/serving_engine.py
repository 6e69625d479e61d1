"""What the generation endpoints share: request checks, sampling parameters, chat rendering,
logprob formatting, and the life of a request in flight (metrics, abort on disconnect).

Every check raises `BadRequestError` naming the field where the bad value enters, so that a
client gets a 400 with `param` set before anything reaches the engine.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from vllm_neuron import metrics
from vllm_neuron.engine.protocol import EngineClient
from vllm_neuron.entrypoints.openai.errors import (
    BadRequestError,
    InternalServerError,
    ServiceUnavailableError,
    format_validation_error,
)
from vllm_neuron.entrypoints.openai.serving_models import OpenAIServingModels
from vllm_neuron.logger import init_logger, warning_once
from vllm_neuron.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from vllm_neuron.sampling_params import RequestOutputKind, SamplingParams
from vllm_neuron.structured_output.params import StructuredOutputsParams

logger = init_logger(__name__)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


def _is_set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {} and value != ""


# Fields with a meaning we cannot honour yet: refused with a 400 when set, never ignored.
_UNSUPPORTED_COMMON: dict[str, Callable[[Any], bool]] = {
    "use_beam_search": _is_set,
    "logits_processors": _is_set,
    "prompt_embeds": _is_set,
    "thinking_token_budget": lambda v: v is not None and v != -1,
    "repetition_detection": _is_set,
    "kv_transfer_params": _is_set,
    "ec_transfer_params": _is_set,
    "watermarking": _is_set,
    "logprob_token_ids": _is_set,
    "vllm_xargs": _is_set,
    "cache_salt": _is_set,
    "priority": lambda v: v not in (None, 0),
}
_UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    "functions": _is_set,
    "function_call": lambda v: v not in (None, "none"),
    "audio": _is_set,
    "modalities": lambda v: _is_set(v) and list(v) != ["text"],
    "prediction": _is_set,
    "web_search_options": _is_set,
}
_UNSUPPORTED_COMPLETION: dict[str, Callable[[Any], bool]] = {"suffix": _is_set}
# Known fields that change nothing in the output: accepted silently.
_HARMLESS = {"metadata", "store", "service_tier", "stream_interval", "session_id", "return_token_offsets",
             "return_mm_kwargs", "routed_experts_prompt_start", "guided_decoding_backend",
             "media_io_kwargs", "parallel_tool_calls", "include_reasoning"}

_PARAM_RE = re.compile(r"\b(n|temperature|top_p|top_k|min_p|seed|presence_penalty|frequency_penalty|"
                       r"repetition_penalty|max_tokens|min_tokens|logprobs|prompt_logprobs|stop_token_ids|"
                       r"stop|bad_words|logit_bias|allowed_token_ids)\b")


def check_unsupported_fields(data: dict[str, Any], known: set[str], chat: bool) -> None:
    table = {**_UNSUPPORTED_COMMON, **(_UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETION)}
    for key, value in data.items():
        is_set = table.get(key)
        if is_set is not None:
            if is_set(value):
                raise BadRequestError(f"`{key}` is not supported by this server yet.", param=key)
        elif key not in known and key not in _HARMLESS:
            warning_once(logger, "The following field was present in the request but ignored: %s", key)
    best_of, n = data.get("best_of"), data.get("n") or 1
    if best_of is not None and best_of != n:
        raise BadRequestError(f"best_of must be equal to n ({n}) on this server, got {best_of}; "
                              "best_of > n is not supported.", param="best_of")


def load_chat_template(template: str | None) -> str | None:
    """--chat-template is a file path or the template itself (vLLM's rule)."""
    if template is None:
        return None
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    if any(c in template for c in "{}\n"):
        return template
    raise ValueError(f"--chat-template {template!r} is neither an existing file nor a Jinja template")


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Turns OpenAI messages into what chat templates expect: text content as one string."""
    if not messages:
        raise BadRequestError("`messages` must contain at least one message.", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequestError(f"messages[{i}] must be an object with a string `role`.",
                                  param=f"messages[{i}].role")
        msg = dict(msg)
        if msg["role"] == "assistant" and isinstance(msg.get("tool_calls"), list):
            msg["tool_calls"] = [_template_tool_call(tc) for tc in msg["tool_calls"]]
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text" or not isinstance(part.get("text"), str):
                    raise BadRequestError(f"Content part type {kind!r} is not supported; only 'text' parts are.",
                                          param=f"messages[{i}].content[{j}].type")
                texts.append(part["text"])
            msg["content"] = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise BadRequestError(f"messages[{i}].content must be a string or a list of content parts.",
                                  param=f"messages[{i}].content")
        out.append(msg)
    return out


def _template_tool_call(tool_call: Any) -> Any:
    # OpenAI sends arguments as JSON text; chat templates iterate over them as a mapping.
    fn = tool_call.get("function") if isinstance(tool_call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            return tool_call
        if isinstance(args, dict):
            return {**tool_call, "function": {**fn, "arguments": args}}
    return tool_call


def render_chat(tokenizer: Any, messages: list[Any], *, template: str | None, add_generation_prompt: bool,
                continue_final_message: bool, template_kwargs: dict[str, Any] | None = None,
                documents: list[dict[str, str]] | None = None, tools: list[dict] | None = None) -> str:
    """The prompt text of a conversation; any template failure is the request's fault (400)."""
    msgs = normalize_messages(messages)
    if continue_final_message and msgs[-1].get("role") != "assistant":
        raise BadRequestError("continue_final_message requires the last message to be from the assistant.",
                              param="continue_final_message")
    kwargs = dict(template_kwargs or {})
    for reserved in ("conversation", "messages", "tokenize", "chat_template"):
        kwargs.pop(reserved, None)
    try:
        text = tokenizer.apply_chat_template(
            msgs, chat_template=template, tools=tools, documents=documents, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **kwargs)
    except Exception as e:  # jinja2 errors, missing template, bad message shapes
        raise BadRequestError(f"Chat template error: {type(e).__name__}: {e}", param="messages") from None
    if not isinstance(text, str):
        raise BadRequestError("Chat template did not render to a string.", param="chat_template")
    return text


def context_error(max_model_len: int, prompt_len: int, requested: int | None) -> str:
    if requested is None:
        return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len} tokens in the messages, Please reduce the length of the messages.")
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the completion). "
            "Please reduce the length of the messages or completion.")


class RequestTracker:
    """The engine requests of one HTTP request: metrics from the stream, abort of what is left
    unfinished when the HTTP request ends early (client gone, error, cancellation)."""

    def __init__(self, serving: OpenAIServing, arrival: float) -> None:
        self._serving = serving
        self._arrival = arrival  # time.monotonic() when the HTTP request arrived
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


class OpenAIServing:
    def __init__(self, engine: EngineClient, models: OpenAIServingModels, *, max_logprobs: int = 20,
                 chat_template: str | None = None, return_tokens_as_token_ids: bool = False,
                 record_metrics: bool = True) -> None:
        self.engine = engine
        self.models = models
        self.max_logprobs = max_logprobs
        self.chat_template = chat_template
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.record_metrics = record_metrics
        self._background: set[asyncio.Task] = set()

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
            raise BadRequestError(f"Requested sample logprobs of {wanted}, which is greater than max allowed: "
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
                              prompt_logprobs: int | None,
                              structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        self.check_token_ids(list(req.stop_token_ids or []), "stop_token_ids")
        self.check_token_ids(list(req.allowed_token_ids or []), "allowed_token_ids")
        logit_bias = None
        if req.logit_bias:
            try:
                logit_bias = {int(k): max(-100.0, min(100.0, float(v))) for k, v in req.logit_bias.items()}
            except (TypeError, ValueError):
                raise BadRequestError("logit_bias keys must be token ids (integers as strings).",
                                      param="logit_bias") from None
            self.check_token_ids(list(logit_bias), "logit_bias")
        try:
            sp = SamplingParams(
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
                prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens, logit_bias=logit_bias,
                allowed_token_ids=req.allowed_token_ids, structured_outputs=structured_outputs,
                # DELTA even for non-streaming requests: the server sees every token arrive (metrics,
                # disconnect checks) and assembles the final text itself.
                output_kind=RequestOutputKind.DELTA)
            sp.verify(self.vocab_size, None if self.max_logprobs == -1 else self.max_logprobs)
        except ValueError as e:
            match = _PARAM_RE.search(str(e))
            raise BadRequestError(str(e), param=match.group(1) if match else None) from None
        return sp

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    # ---- requests in flight ---------------------------------------------------------------------

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
                       prompt_tokens: int) -> AsyncIterator[RequestOutput]:
        tracker.start(request_id, prompt_tokens)
        try:
            async for res in self.engine.generate(prompt, sp, request_id):
                tracker.observe(res)
                yield res
        except ValueError as e:
            # The engine refuses a request it cannot take (documented in EngineClient.generate).
            raise BadRequestError(str(e)) from e

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


async def run_until_disconnect(work: Awaitable[T], raw_request: Request) -> T | None:
    """Runs `work`, cancelling it when the client disconnects first (then returns None). The
    cancellation reaches the generation loop, whose finally aborts the engine requests."""
    task = asyncio.ensure_future(work)

    async def _listen() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(_listen())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    logger.info("Client disconnected; request aborted")
    return None


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """Yields (iterator index, item) as items arrive from any iterator."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                try:
                    item = fut.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        for fut in pending:
            fut.cancel()


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


def prompt_logprobs_json(plp: PromptLogprobs | None) -> list[dict[int, dict[str, Any]] | None] | None:
    if plp is None:
        return None
    return [None if step is None else
            {tid: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in step.items()} for step in plp]


def parse_request(model_cls: type[M], data: dict[str, Any]) -> M:
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        message, param = format_validation_error(e)
        raise BadRequestError(message, param=param) from None


def sse(payload: BaseModel, **dump_kwargs: Any) -> str:
    return f"data: {payload.model_dump_json(**dump_kwargs)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
