"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's JSON, parsed and validated (pure).

Fields (vLLM's names): `method` (ngram | eagle3 | dflash), `num_speculative_tokens` (K, drafts per
step), `model` (the draft checkpoint; required for eagle3 / dflash, refused for ngram),
`prompt_lookup_min` / `prompt_lookup_max` (ngram only; the shortest / longest suffix n-gram looked up
in the request's own tokens), `disable_by_batch_size` (a step with at least this many running requests
carries no drafts, as vLLM's V0 worker applied it; >= 2 as vLLM requires; None: never). Defaults for
ngram as vLLM: both 5 when neither is given, else the one given. Every bad value is a ValueError naming
the option and what is valid.

Draft-vs-target checks that need both model configs (vocabulary, hidden size) are in
`check_draft_compatible`, called when the draft is loaded.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from vllm_neuron.config import validate as V
from vllm_neuron.config.json_object import parse_json_object

SPECULATIVE_METHODS = ("ngram", "eagle3", "dflash")
# Every K is one verification graph per decode batch bucket: keep the set of graphs small.
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP = 5
_NS = "speculative_config"
# vLLM fields we accept when they carry their default meaning (None) and refuse otherwise.
_ACCEPTED_IF_UNSET = ("draft_tensor_parallel_size", "quantization", "revision", "code_revision",
                      "max_model_len", "speculative_token_tree", "parallel_drafting")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None

    @property
    def uses_draft_model(self) -> bool:
        return self.method != "ngram"

    def describe(self) -> str:
        if self.method == "ngram":
            text = (f"ngram (prompt lookup {self.prompt_lookup_min}..{self.prompt_lookup_max}), "
                    f"{self.num_speculative_tokens} speculative tokens")
        else:
            text = f"{self.method} draft {self.model!r}, {self.num_speculative_tokens} speculative tokens"
        if self.disable_by_batch_size is not None:
            text += f", off in steps of >= {self.disable_by_batch_size} running requests"
        return text


def _int_field(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    return V.integer(f"{_NS}.{name}", value, minimum=minimum, maximum=maximum)


def parse_speculative_config(value: dict | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """None / {} -> None (no speculation); a dict or its JSON text -> a validated SpeculativeConfig."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    value = parse_json_object(value, "--speculative-config is not valid JSON: {error}",
                              f"{_NS} must be a JSON object, got {{type}}")
    if not value:
        return None
    d = dict(value)
    known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    for name in _ACCEPTED_IF_UNSET:
        if d.pop(name, None) is not None:
            raise ValueError(f"{_NS}.{name} is not supported yet by vllm-neuron; leave it unset")
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown {_NS} field(s) {unknown}; valid fields: {sorted(known)}")
    method = d.get("method")
    if method is None and d.get("model") in ("ngram", "[ngram]"):
        method, d["model"] = "ngram", None  # vLLM's legacy spelling
    if method == "[ngram]":
        method = "ngram"
    V.choice(f"{_NS}.method", method, SPECULATIVE_METHODS)
    if "num_speculative_tokens" not in d:
        raise ValueError(f"{_NS}.num_speculative_tokens is required (1..{MAX_SPECULATIVE_TOKENS})")
    k = _int_field("num_speculative_tokens", d["num_speculative_tokens"], 1, MAX_SPECULATIVE_TOKENS)
    model = d.get("model")
    lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
    if method == "ngram":
        if model is not None:
            raise ValueError(f"{_NS}.model={model!r}: method 'ngram' uses no draft model; remove 'model'")
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo = _int_field("prompt_lookup_min", hi if lo is None else lo, 1)
        hi = _int_field("prompt_lookup_max", lo if hi is None else hi, 1)
        if lo > hi:
            raise ValueError(f"{_NS}.prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    else:
        if lo is not None or hi is not None:
            raise ValueError(f"{_NS}.prompt_lookup_min/prompt_lookup_max apply to method 'ngram' only, "
                             f"not {method!r}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"{_NS}.model is required for method {method!r}: the draft checkpoint directory")
    off_at = d.get("disable_by_batch_size")
    if off_at is not None:
        off_at = _int_field("disable_by_batch_size", off_at, 2)
    return SpeculativeConfig(method, k, model, lo, hi, off_at)


def check_draft_compatible(spec: SpeculativeConfig, *, target_vocab: int, target_hidden: int,
                           draft_vocab: int, draft_hidden: int, draft_target_hidden: int | None = None) -> None:
    """Refuses a draft whose vocabulary or hidden size does not fit the target (raised at start-up).

    draft_target_hidden: the target hidden size the draft was trained on, when its config records it
    (EAGLE3's `target_hidden_size`)."""
    where = f"{_NS}.model={spec.model!r}"
    if draft_vocab > target_vocab:
        raise ValueError(f"{where}: draft vocabulary ({draft_vocab}) is larger than the target's ({target_vocab})")
    expected = draft_target_hidden if draft_target_hidden is not None else draft_hidden
    if expected != target_hidden:
        raise ValueError(f"{where}: draft expects target hidden size {expected}, the target has {target_hidden}")
