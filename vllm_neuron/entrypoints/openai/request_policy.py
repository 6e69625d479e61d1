"""Request policy: which fields are refused, which are harmless, and the server's request limits.

Every check raises `BadRequestError` naming the field where the bad value enters, so that a
client gets a 400 with `param` set before anything reaches the engine. Checks here need no model;
those that do (vocabulary, context length) live on `OpenAIServing`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from pydantic import BaseModel, ValidationError

from vllm_neuron.config import validate as V
from vllm_neuron.entrypoints.openai.errors import BadRequestError, format_validation_error
from vllm_neuron.logger import init_logger, warning_once

logger = init_logger(__name__)

M = TypeVar("M", bound=BaseModel)

DEFAULT_MAX_N = 64
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
# 8 MiB (the default body limit) in 30 s is 2.2 Mbit/s: slower clients raise --body-read-timeout.
DEFAULT_BODY_READ_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask of the server (--max-n, --max-request-body-bytes,
    --trust-request-chat-template, --body-read-timeout)."""

    max_n: int = DEFAULT_MAX_N
    max_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    trust_request_chat_template: bool = False
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_n < 1:
            raise ValueError(f"--max-n must be at least 1, got {self.max_n}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"--max-request-body-bytes must be at least 1024, got {self.max_body_bytes}")
        V.number("--body-read-timeout", self.body_read_timeout_s, minimum=0.0, min_exclusive=True)

    def check_n(self, n: int | None) -> None:
        if n is None:
            return
        if n < 1:
            raise BadRequestError(f"n must be at least 1, got {n}.", param="n")
        if n > self.max_n:
            raise BadRequestError(f"n must be at most {self.max_n} on this server (--max-n), got {n}.", param="n")

    def check_chat_template(self, template: str | None) -> None:
        """A request-supplied template is code run by the server: refused unless trusted (vLLM's rule)."""
        if template is not None and not self.trust_request_chat_template:
            raise BadRequestError("Chat template is passed with request, but --trust-request-chat-template is not "
                                  "set. Refused request with untrusted chat template.", param="chat_template")


def _is_set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {} and value != ""


# Fields with a meaning we cannot honour yet: refused with a 400 when set, never ignored.
_UNSUPPORTED_COMMON: dict[str, Callable[[Any], bool]] = {
    "logits_processors": _is_set,
    "thinking_token_budget": lambda v: v is not None and v != -1,
    "repetition_detection": _is_set,
    "ec_transfer_params": _is_set,
    "watermarking": _is_set,
    "logprob_token_ids": _is_set,
    "vllm_xargs": _is_set,
    "cache_salt": _is_set,
}
_UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    "functions": _is_set,
    "function_call": lambda v: v not in (None, "none"),
    "audio": _is_set,
    "modalities": lambda v: _is_set(v) and list(v) != ["text"],
    "prediction": _is_set,
    "web_search_options": _is_set,
    "prompt_embeds": _is_set,  # vLLM takes them on /v1/completions only
    "use_beam_search": _is_set,  # built on /v1/completions (and LLM.beam_search) only
}
_UNSUPPORTED_COMPLETION: dict[str, Callable[[Any], bool]] = {"suffix": _is_set}
_MAX_WARNED_FIELDS = 64
_warned_fields: set[str] = set()
# Known fields that change nothing in the output: accepted silently.
_HARMLESS = {"metadata", "store", "service_tier", "stream_interval", "session_id", "return_token_offsets",
             "return_mm_kwargs", "routed_experts_prompt_start", "guided_decoding_backend",
             "media_io_kwargs", "parallel_tool_calls", "include_reasoning"}

_PARAM_RE = re.compile(r"\b(n|temperature|top_p|top_k|min_p|seed|presence_penalty|frequency_penalty|"
                       r"repetition_penalty|max_tokens|min_tokens|logprobs|prompt_logprobs|stop_token_ids|"
                       r"stop|bad_words|logit_bias|allowed_token_ids)\b")


def param_of_error(message: str) -> str | None:
    """The request field a SamplingParams error message names, if any."""
    match = _PARAM_RE.search(message)
    return match.group(1) if match else None


def check_unsupported_fields(data: dict[str, Any], known: set[str], chat: bool) -> None:
    table = {**_UNSUPPORTED_COMMON, **(_UNSUPPORTED_CHAT if chat else _UNSUPPORTED_COMPLETION)}
    for key, value in data.items():
        is_set = table.get(key)
        if is_set is not None:
            if is_set(value):
                raise BadRequestError(f"`{key}` is not supported by this server yet.", param=key)
        elif key not in known and key not in _HARMLESS and len(_warned_fields) < _MAX_WARNED_FIELDS:
            # Names come from clients: a bounded set, so that random keys cannot grow memory or flood the log.
            _warned_fields.add(key[:64])
            warning_once(logger, "The following field was present in the request but ignored: %s", key[:64])
    best_of, n = data.get("best_of"), data.get("n") or 1
    if best_of is not None and best_of != n:
        raise BadRequestError(f"best_of must be equal to n ({n}) on this server, got {best_of}; "
                              "best_of > n is not supported.", param="best_of")


def context_error(max_model_len: int, prompt_len: int, requested: int | None) -> str:
    if requested is None:
        return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len} tokens in the messages, Please reduce the length of the messages.")
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the completion). "
            "Please reduce the length of the messages or completion.")


def parse_request(model_cls: type[M], data: dict[str, Any]) -> M:
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        message, param = format_validation_error(e)
        raise BadRequestError(message, param=param) from None
