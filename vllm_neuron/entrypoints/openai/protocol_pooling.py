"""Pydantic models of the pooling endpoints, with vLLM's field names: /v1/embeddings (OpenAI's shape),
/pooling, /classify, /score and /rerank (/v1/rerank, /v2/rerank: Jina's and Cohere's shape)."""
from __future__ import annotations

import time
from typing import Literal, Union

from pydantic import Field

from vllm_neuron.entrypoints.openai.protocol import OpenAIBaseModel, OpenAIRequestModel, UsageInfo, random_uuid

# One prompt (text or token ids) or a batch of them.
PoolingInput = Union[str, list[str], list[int], list[list[int]]]


class _PoolingRequestBase(OpenAIRequestModel):
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # keep the last N tokens; -1: max_model_len
    add_special_tokens: bool = True
    priority: int = 0
    request_id: str | None = None


class EmbeddingRequest(_PoolingRequestBase):
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    normalize: bool | None = None


class PoolingRequest(EmbeddingRequest):
    """/pooling: the model's own pooled output (its task's), vLLM's shape."""


class ClassificationRequest(_PoolingRequestBase):
    input: PoolingInput
    use_activation: bool | None = None


class ScoreRequest(_PoolingRequestBase):
    """text_1 against text_2: one against many or pairs in order (vLLM's names; queries/documents accepted)."""

    text_1: Union[str, list[str], None] = None
    text_2: Union[str, list[str], None] = None
    queries: Union[str, list[str], None] = None
    documents: Union[str, list[str], None] = None
    use_activation: bool | None = None


class RerankRequest(_PoolingRequestBase):
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)  # 0: every document
    return_documents: bool = True
    use_activation: bool | None = None


class _ListResponse(OpenAIBaseModel):
    """The envelope every pooling response but /rerank's shares."""

    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: UsageInfo


class EmbeddingResponseData(OpenAIBaseModel):
    index: int
    object: str = "embedding"
    embedding: Union[list[float], str]


class EmbeddingResponse(_ListResponse):
    id: str = Field(default_factory=lambda: f"embd-{random_uuid()}")
    data: list[EmbeddingResponseData]


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: str = "pooling"
    data: Union[list[float], str]


class PoolingResponse(_ListResponse):
    id: str = Field(default_factory=lambda: f"pool-{random_uuid()}")
    data: list[PoolingResponseData]


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(_ListResponse):
    id: str = Field(default_factory=lambda: f"classify-{random_uuid()}")
    data: list[ClassificationData]


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: str = "score"
    score: float


class ScoreResponse(_ListResponse):
    id: str = Field(default_factory=lambda: f"score-{random_uuid()}")
    data: list[ScoreResponseData]


class RerankDocument(OpenAIBaseModel):
    text: str


class RerankResult(OpenAIBaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(OpenAIBaseModel):
    total_tokens: int
    prompt_tokens: int | None = None


class RerankResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"rerank-{random_uuid()}")
    model: str
    usage: RerankUsage
    results: list[RerankResult]
