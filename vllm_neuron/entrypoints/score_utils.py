"""What offline `LLM.score` and the server's /score and /rerank share (pure but for the tokenizer): the
(query, document) pairs of a request, a cross-encoder's pair prompt, and an embedding model's score."""
from __future__ import annotations

from typing import Any

import torch


def broadcast_pairs(data_1: Any, data_2: Any) -> list[tuple[Any, Any]]:
    """vLLM's rule: one text_1 against every text_2 (1:N), or as many of each paired in order (N:N)."""
    first = [data_1] if isinstance(data_1, (str, dict)) else list(data_1)
    second = [data_2] if isinstance(data_2, (str, dict)) else list(data_2)
    if not first or not second:
        raise ValueError("score needs at least one text on each side")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 and text_2 must be one against many or the same number of texts; got "
                         f"{len(first)} and {len(second)}")
    return list(zip(first, second))


def pair_token_ids(tokenizer: Any, query: str, document: str) -> list[int]:
    """A cross-encoder's input: the tokenizer's own pair encoding (its template for text pairs, plain
    concatenation for a tokenizer without one)."""
    return list(tokenizer(query, document)["input_ids"])


def cosine_score(a: torch.Tensor, b: torch.Tensor) -> float:
    """An embedding model's score of two texts: the cosine similarity of their embeddings."""
    return torch.nn.functional.cosine_similarity(a.float()[None], b.float()[None]).item()
