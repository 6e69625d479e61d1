"""vLLM-shaped request outputs: what `LLM.generate` returns and what the engine streams."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class Logprob:
    """Log probability of one token; rank is 1-based among the model's raw logits."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts it).
PromptLogprobs = list[Union[dict[int, Logprob], None]]


@dataclass
class CompletionOutput:
    """One of the n completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended the completion; None for EOS or length.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, token_ids={self.token_ids}, "
                f"cumulative_logprob={self.cumulative_logprob}, "
                f"logprobs={'None' if self.logprobs is None else f'<{len(self.logprobs)} tokens>'}, "
                f"finish_reason={self.finish_reason}, stop_reason={self.stop_reason!r})")


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of a request's life; None until reached."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The output of one request: its prompt and its n completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int | None = None
    # Disaggregated prefill/decode: on a prefill instance's final output, what the decode instance needs
    # (vLLM's kv_transfer_params: pass it in the decode request's SamplingParams.extra_args).
    kv_transfer_params: dict | None = None

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, "
                f"prompt_logprobs={'None' if self.prompt_logprobs is None else '<...>'}, "
                f"outputs={self.outputs}, finished={self.finished}, metrics={self.metrics}, "
                f"num_cached_tokens={self.num_cached_tokens})")


@dataclass
class PoolingOutput:
    """What a pooling model returns for one prompt: `data`, a 1-D float tensor (an embedding, the class
    probabilities or logits, or one score)."""

    data: "object"  # torch.Tensor [n] (float32, CPU); kept untyped so this module imports no torch


@dataclass
class PoolingRequestOutput:
    """vLLM's `PoolingRequestOutput`: one prompt's pooled output (`LLM.encode`)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """`LLM.embed`'s: outputs.embedding is a list of floats."""

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, EmbeddingOutput(out.outputs.data.tolist()), out.prompt_token_ids, out.finished,
                   out.prompt, out.metrics)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """`LLM.classify`'s: outputs.probs, one per label."""

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return cls(out.request_id, ClassificationOutput(out.outputs.data.tolist()), out.prompt_token_ids,
                   out.finished, out.prompt, out.metrics)


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    """`LLM.score`'s: outputs.score, one float per (query, document) pair."""

    @classmethod
    def from_score(cls, out: PoolingRequestOutput, score: float) -> "ScoringRequestOutput":
        return cls(out.request_id, ScoringOutput(score), out.prompt_token_ids, out.finished, out.prompt,
                   out.metrics)
