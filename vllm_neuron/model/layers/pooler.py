"""The pooling heads' arithmetic on pooled hidden states (pure torch): Matryoshka truncation, L2
normalization, the classifier's activation. Pooling itself (which rows) is worker/pooling.py's, across the
prefill chunks of a request."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def embedding_head(pooled: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """[H] -> the embedding: the first `dimensions` values (Matryoshka), then L2-normalized when asked
    (truncating first keeps a truncated embedding unit-length, as sentence-transformers does)."""
    x = pooled.float()
    if dimensions is not None:
        x = x[..., :dimensions]
    return F.normalize(x, p=2, dim=-1) if normalize else x


def classifier_activation(logits: torch.Tensor, use_activation: bool) -> torch.Tensor:
    """[..., labels] logits -> probabilities: sigmoid for one label (a score), softmax over several; the raw
    logits when the activation is off."""
    x = logits.float()
    if not use_activation:
        return x
    return torch.sigmoid(x) if x.shape[-1] == 1 else torch.softmax(x, dim=-1)
