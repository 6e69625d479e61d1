"""A generative family's class turned into a pooling model: the same decoder, without the language-model head
(embed), or with a classification head (classify).

The forward is the family's own (hidden states after the final norm); the runner's pooler (worker/pooling.py)
pools them and calls `classify_logits` for a classifier. Checkpoints load from any of the layouts transformers
writes: a `*ForCausalLM` (its lm_head is skipped for embeddings), a bare `*Model` (tensor names without the
`model.` prefix, e.g. Qwen3-Embedding), or a `*ForSequenceClassification` (`score.weight`, one row per label).
A classifier whose config names `classifier_from_token` (the Qwen3-Reranker form: a causal LM scored by its
"no" / "yes" logits) keeps the lm_head and reads the logits of those tokens instead of a score head.
"""
from __future__ import annotations

import functools

import torch

from vllm_neuron.model.base import CausalLM, Target
from vllm_neuron.model.layers.linear import EncoderLinear

_OWN_PREFIXES = ("model.", "lm_head.", "score.")


class _PoolingAdapter:
    """Mixed in front of a family's class (see `pooling_model_class`)."""

    pooling_task = ""

    def _pooling_checkpoint_name(self, name: str) -> str:
        # A bare *Model checkpoint names its tensors without the wrapper's `model.` prefix.
        return name if name.startswith(_OWN_PREFIXES) else "model." + name


class _EmbeddingAdapter(_PoolingAdapter):
    pooling_task = "embed"

    def __init__(self, hf_config, quantization: str | None = None) -> None:
        super().__init__(hf_config, quantization)
        self.lm_head = None  # no vocabulary projection: the hidden states are the output

    def checkpoint_target(self, name: str) -> Target | None:
        name = self._pooling_checkpoint_name(name)
        if name.startswith(("lm_head.", "score.")):
            return None  # a causal LM's (or classifier's) head: an embedder does not use it
        return super().checkpoint_target(name)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{type(self).__name__} is an embedding model: it has no logits")


class _ClassifierAdapter(_PoolingAdapter):
    pooling_task = "classify"

    def __init__(self, hf_config, quantization: str | None = None) -> None:
        super().__init__(hf_config, quantization)
        self.from_tokens = bool(getattr(hf_config, "classifier_from_token", None))
        if not self.from_tokens:
            self.lm_head = None
            self.score = EncoderLinear(hf_config.get_text_config().hidden_size, int(hf_config.num_labels), bias=False)

    def checkpoint_target(self, name: str) -> Target | None:
        name = self._pooling_checkpoint_name(name)
        if name.startswith("score."):
            return (name, None, None) if not self.from_tokens else None
        if name.startswith("lm_head.") and not self.from_tokens:
            return None
        return super().checkpoint_target(name)

    def classify_logits(self, pooled: torch.Tensor, token_ids: tuple[int, ...] = ()) -> torch.Tensor:
        """[B, labels] logits of pooled hidden states [B, hidden]. The token form: the logits of `token_ids`;
        two tokens ("no", "yes") give one label, their difference (sigmoid of it = softmax's "yes")."""
        if not self.from_tokens:
            return self.score(pooled.to(self.score.weight.dtype)).float()
        w = self.lm_head.weight[list(token_ids)]
        logits = (pooled.to(w.dtype) @ w.T).float()
        return logits[:, 1:] - logits[:, :1] if len(token_ids) == 2 else logits


@functools.lru_cache(maxsize=None)
def pooling_model_class(base: type[CausalLM], task: str) -> type[CausalLM]:
    """`base` (a family's CausalLM class) converted for `task` ("embed" or "classify"); one class per pair."""
    adapter = {"embed": _EmbeddingAdapter, "classify": _ClassifierAdapter}[task]
    suffix = "ForEmbedding" if task == "embed" else "ForSequenceClassification"
    name = base.__name__.removesuffix("ForCausalLM") + suffix
    return type(name, (adapter, base), {"__module__": __name__, "__doc__": f"{base.__name__} converted to {task}."})
