"""`PoolingParams`: what a pooling request (embed / classify / score / encode) asks of a pooling model.

The counterpart of `SamplingParams` for a pooling engine (`--runner pooling`): it crosses the process boundary
inside EngineCoreRequest (pickled), so it stays free of torch. Checked against the model's pooler
(`config/pooler_config.py`'s `PoolingSetup`) where it enters: `verify` raises a ValueError naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# What a pooling request may ask for; the model's task (embed or classify) decides which it serves.
POOLING_TASKS = ("embed", "classify", "score", "encode")
# Which request tasks an engine converted for a task serves.
TASKS_OF_MODEL = {"embed": ("embed", "encode"), "classify": ("classify", "score", "encode")}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_dimensions(dimensions: int, matryoshka: bool | tuple[int, ...] | None, hidden_size: int,
                     option: str) -> None:
    """A Matryoshka embedding size asked for (`option`: the request's field or --pooler-config's) must be one
    the model declares (config.json is_matryoshka / matryoshka_dimensions) and fit its hidden size."""
    if not matryoshka:
        raise ValueError(f"{option}: model does not support matryoshka representation (config.json is_matryoshka "
                         "or matryoshka_dimensions), changing output dimensions will lead to poor results.")
    if isinstance(matryoshka, (tuple, list)) and dimensions not in matryoshka:
        raise ValueError(f"{option}={dimensions} is not supported by this model; supported: {list(matryoshka)}")
    if dimensions > hidden_size:
        raise ValueError(f"{option} must be at most the model's embedding size {hidden_size}, got {dimensions}")


@dataclass
class PoolingParams:
    """vLLM's names: `dimensions` (Matryoshka truncation of an embedding), `normalize` (None: the model's
    pooler config), `use_activation` (classify / score: softmax or sigmoid; None: on), `truncate_prompt_tokens`
    (keep the last N prompt tokens; -1: max_model_len)."""

    task: str | None = None  # None: the model's own task
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        for name in ("normalize", "use_activation"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"{name} must be true or false, got {v!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer or -1 (max_model_len), got {t!r}")

    def clone(self) -> "PoolingParams":
        return PoolingParams(self.task, self.dimensions, self.normalize, self.use_activation,
                             self.truncate_prompt_tokens)

    def verify(self, model_task: str, hidden_size: int, matryoshka: bool | tuple[int, ...] | None) -> "PoolingParams":
        """A copy with `task` filled in, checked against the model: its task (`embed` or `classify`), the
        embedding size, and whether it takes `dimensions` (a Matryoshka model: True, or the sizes it allows)."""
        task = self.task or model_task
        if task not in TASKS_OF_MODEL[model_task]:
            raise ValueError(f"task {task!r} is not served by this model (a {model_task} model serves "
                             f"{list(TASKS_OF_MODEL[model_task])})")
        if self.dimensions is not None:
            if task != "embed":
                raise ValueError(f"dimensions applies to embeddings only, not to task {task!r}")
            check_dimensions(self.dimensions, matryoshka, hidden_size, "dimensions")
        out = self.clone()
        out.task = task
        return out
