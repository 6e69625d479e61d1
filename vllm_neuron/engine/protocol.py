"""The contract between the HTTP layer and the engine: what a server may ask of an engine client.

The OpenAI server codes against `EngineClient` only; `AsyncLLM` (engine process over ZMQ) implements it,
and tests may implement it with a fake. Nothing here knows about blocks or tensors.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, TypedDict, Union

from vllm_neuron.outputs import RequestOutput
from vllm_neuron.sampling_params import SamplingParams


class TextPrompt(TypedDict, total=False):
    prompt: str
    multi_modal_data: dict[str, Any]


class TokensPrompt(TypedDict, total=False):
    prompt_token_ids: list[int]
    prompt: str  # optional original text, echoed back in outputs
    multi_modal_data: dict[str, Any]  # {"image": [...]}: the prompt holds one placeholder per item
    # Media already processed by `EngineClient.process_multimodal` (placeholders expanded in the ids).
    multi_modal_items: list[Any]
    prompt_embeds: Any  # [seq_len, hidden] torch tensor in place of token ids (--enable-prompt-embeds)


PromptType = Union[str, list[int], TextPrompt, TokensPrompt]


class EngineDeadError(RuntimeError):
    """The engine process died; every request in flight fails with this."""


class EngineRequestError(RuntimeError):
    """The engine failed one request (an error in its setup or in a step that held it); the engine
    and every other request keep running."""


class EngineOverloadedError(RuntimeError):
    """The engine cannot take this request now (its queue is full, or its grammar compiler is busy): the
    client should retry after `retry_after_s` seconds (a 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


class AdmissionTicket:
    """A request's place among the engine requests admitted (see EngineClient.admit); `release` gives it
    back (idempotent). This one bounds nothing: engine clients without admission control hand it out."""

    def release(self) -> None:
        pass


@dataclass
class ModelInfo:
    model_path: str  # what was loaded (dir or .gguf file)
    max_model_len: int
    eos_token_id: int | None
    # SamplingParams defaults from the generation config (--generation-config); fill unset request fields.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # --enable-prompt-embeds: the hidden size a prompt's embeddings must have; None: prompt_embeds refused.
    prompt_embeds_hidden_size: int | None = None
    # A pooling engine's pooler (config/pooler_config.py's PoolingSetup); None: a generative engine.
    pooling: Any = None


class EngineClient(ABC):
    """What the OpenAI server needs from an engine."""

    model_info: ModelInfo
    tokenizer: Any  # a transformers PreTrainedTokenizerFast

    @abstractmethod
    def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, priority: int = 0,
        lora_request: Any = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields RequestOutputs as tokens arrive, per sampling_params.output_kind (CUMULATIVE: full text
        so far; DELTA: only the new text/tokens; FINAL_ONLY: one output at the end). The last one has
        finished=True. Raises ValueError for invalid input (prompt longer than max_model_len, ...) before
        the first output; EngineRequestError if the engine fails this request; EngineDeadError if the
        engine dies. Cancelling the consumer aborts the request. priority: --scheduling-policy priority's
        order, lower first (a ValueError when not 0 under fcfs). lora_request: the request's LoRA adapter
        (lora/request.py; None: the base model; callers pass it only when set)."""

    @property
    def lora_checker(self) -> Any:
        """The adapter check of an engine with LoRA on (lora/peft_adapter.py's AdapterChecker); None: off."""
        return None

    def encode(self, prompt: PromptType, pooling_params: Any, request_id: str,
               priority: int = 0) -> AsyncGenerator[Any, None]:
        """A pooling engine's request (pooling_params.PoolingParams): yields one PoolingRequestOutput; errors as
        `generate`'s. An engine without pooling raises ValueError."""
        raise ValueError("This engine does not serve pooling requests")

    def admit(self, weight: int) -> AdmissionTicket:
        """Reserves room for `weight` engine requests (n x prompts) before any work is done for them;
        raises EngineOverloadedError when the engine has no room. Release the ticket when the request ends
        (its streams finished, failed or were cancelled)."""
        return AdmissionTicket()

    def check_structured_outputs(self, params: Any, max_tokens: int | None = None) -> None:
        """Blocking (call it off the event loop): a StructuredOutputsParams' size limits and compilation.
        Raises ValueError naming the problem; EngineOverloadedError when the grammar compiler is busy."""
        from vllm_neuron.structured_output.compiler import make_tokenizer_info, validate

        validate(params, make_tokenizer_info(self.tokenizer))

    @property
    def is_multimodal(self) -> bool:
        """Whether the model takes media (image / video content parts)."""
        return False

    @property
    def audio_processor(self) -> Any:
        """An audio model's processor (multimodal/audio_processor.py: sampling rate, longest clip); None when
        the model does not transcribe (the /v1/audio routes answer 400)."""
        return None

    def process_multimodal(self, token_ids: list[int], media: dict[str, list],
                           mm_processor_kwargs: dict[str, Any] | None = None) -> tuple[list[int], list[Any]]:
        """Blocking (fetches and decodes media; call it off the event loop): token ids with one placeholder
        per media item -> (expanded ids, processed items for TokensPrompt.multi_modal_items). Raises
        ValueError naming the problem for bad media."""
        raise ValueError("media content parts are not supported by this model (it takes text only)")

    async def start_profile(self) -> None:
        """Starts torch.profiler in every process of the engine (vllm_neuron/profiler.py); ProfilerError when
        profiling is off (VLLM_TORCH_PROFILER_DIR unset) or a profile runs already."""
        from vllm_neuron.profiler import ProfilerError

        raise ProfilerError(f"{type(self).__name__} does not profile")

    async def stop_profile(self) -> list[str]:
        """Stops the profile once every process wrote its trace; their files. ProfilerError when none runs."""
        from vllm_neuron.profiler import ProfilerError

        raise ProfilerError(f"{type(self).__name__} does not profile")

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Aborts a request; its KV blocks are freed. Unknown ids are ignored."""

    @property
    def warmup_progress(self) -> tuple[int, int] | None:
        """(graphs warmed up, graphs in all) while the engine starts; None when it does not say."""
        return None

    @property
    @abstractmethod
    def is_ready(self) -> bool:
        """True once warm-up and compilation have finished."""

    @property
    @abstractmethod
    def errored(self) -> bool:
        """True if the engine process died."""

    @abstractmethod
    async def check_health(self) -> None:
        """Raises EngineDeadError if the engine is dead."""
