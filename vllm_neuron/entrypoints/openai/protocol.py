"""Pydantic models of the OpenAI-compatible API, with vLLM's field names and defaults.

Requests allow extra fields (as vLLM does); `serving_engine.check_unsupported_fields` decides
which of them are refused because they would change the output, and which are harmless.
Ranges that need no model (seed, temperature, n >= 1, ...) are checked here, so that /openapi.json
states them; checks that need the model or the server's options (vocabulary, context length,
logprob caps, --max-n) live in the serving classes.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_neuron.sampling_params import MAX_TEMPERATURE, SEED_MAX, SEED_MIN


def random_uuid() -> str:
    return uuid.uuid4().hex


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class OpenAIRequestModel(OpenAIBaseModel):
    """Requests are validated strictly: a value of the wrong JSON type (true for an integer, "2" for
    n) is a 400, as /openapi.json says, never silently converted."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats_are_integers(cls, data: Any) -> Any:
        # JSON has one number type and JSON Schema's "integer" includes 16.0: clients that count in
        # floating point (JavaScript, pandas) send 16.0 for 16. 1.5, true and "2" stay errors.
        if not isinstance(data, dict):
            return data
        fields = _integer_fields(cls)
        return {k: (_integral_to_int(v) if k in fields else v) for k, v in data.items()}


_INT_FIELDS: dict[type, frozenset[str]] = {}


def _takes_int(annotation: Any) -> bool:
    return annotation is int or any(_takes_int(arg) for arg in get_args(annotation))


def _integer_fields(model: type[BaseModel]) -> frozenset[str]:
    if model not in _INT_FIELDS:
        _INT_FIELDS[model] = frozenset(name for name, f in model.model_fields.items() if _takes_int(f.annotation))
    return _INT_FIELDS[model]


def _integral_to_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral_to_int(v) for v in value]
    return value


# ---- errors, models, usage ----------------------------------------------------------------------

class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelPermission(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: str = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "vllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class StreamOptions(OpenAIRequestModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


StopParam = Union[str, list[str], None]


class _SamplingFields(OpenAIRequestModel):
    """Fields shared by both generation endpoints (OpenAI's and vLLM's extra sampling fields)."""

    model: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int | None = Field(1, ge=1)  # the maximum is the server's --max-n (in /openapi.json too)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: StopParam = Field(default_factory=list)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None
    # vLLM's sampling extras
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = Field(None, ge=-1)
    bad_words: list[str] = Field(default_factory=list)
    # Structured outputs: vLLM's field and its older aliases (see entrypoints/openai/structured.py)
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[str, dict[str, Any], None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: Union[str, dict[str, Any], None] = None
    # vLLM's extra parameters that do not change the output
    request_id: str | None = None
    priority: int = 0
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # Disaggregated prefill/decode (vLLM's protocol; a server started with --kv-transfer-config)
    kv_transfer_params: dict[str, Any] | None = None


# ---- /v1/completions ----------------------------------------------------------------------------

class CompletionRequest(_SamplingFields):
    prompt: Union[list[int], list[list[int]], str, list[str], None] = None
    # --enable-prompt-embeds: base64 of torch.save'd [seq_len, hidden] tensors, one prompt each (vLLM's encoding)
    prompt_embeds: Union[str, list[str], None] = None
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo
    suffix: str | None = None
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's answer for the decode instance


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions -----------------------------------------------------------------------

class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    logprobs: bool | None = False
    top_logprobs: int | None = Field(0, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    # None: "auto" when tools are given, else "none" (vLLM's default)
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = True
    reasoning_effort: str | None = None
    include_reasoning: bool = True
    # vLLM's chat extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    # Only the fields that are set are sent (streamed chunks are dumped with exclude_unset).
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's name; `reasoning` is its newer one (both are sent)
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's answer for the decode instance
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


# ---- /tokenize, /detokenize ---------------------------------------------------------------------

class TokenizeCompletionRequest(OpenAIRequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIRequestModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
