"""Pooling models: which runner a checkpoint gets (`--runner`, `--convert`, the older `--task`), its pooler
(`--pooler-config` over the sentence-transformers files of the checkpoint over the defaults), and the
resolved `PoolingSetup` the engine runs on (pure but for reading the checkpoint's JSON files).

vLLM's rules: a `*ForSequenceClassification` checkpoint is a classifier, a bare `*Model` (Qwen3Model,
LlamaModel) an embedder, a `*ForCausalLM` generates unless `--runner pooling` / `--convert embed|classify`
converts it (pooling with no convert: embed). Decoder embedders pool the last token, normalized, unless the
checkpoint's sentence-transformers `modules.json` says otherwise (its Pooling module's mode, a Normalize
module or none); `--pooler-config` overrides both.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.config import validate as V
from vllm_neuron.config.json_object import parse_json_object
from vllm_neuron.pooling_params import check_dimensions

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
# The older --task values and what they mean now ((runner, convert); None: the checkpoint decides).
TASKS = {"auto": (None, None), "generate": ("generate", None), "embed": ("pooling", "embed"),
         "embedding": ("pooling", "embed"), "classify": ("pooling", "classify"), "score": ("pooling", "classify")}
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# --pooler-config keys: ours, vLLM's spelling of one, and vLLM's that we refuse rather than ignore.
_POOLER_KEYS = ("pooling_type", "normalize", "dimensions", "use_activation")
_POOLER_ALIASES = {"activation": "use_activation"}
_POOLER_REFUSED = ("enable_chunked_processing", "max_embed_len", "softmax", "step_tag_id", "returned_token_ids",
                   "logit_bias")
# sentence-transformers' Pooling module modes we serve -> our pooling type.
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_MODULES_SERVED = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolerConfig:
    """`--pooler-config`, as given (None: not set)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    use_activation: bool | None = None


def parse_pooler_config(value: dict | str | PoolerConfig | None) -> PoolerConfig | None:
    if value is None or isinstance(value, PoolerConfig):
        return value
    d = parse_json_object(value, "pooler_config must be a JSON object, got {value!r}: {error}",
                          "pooler_config must be a JSON object, got {value!r}")
    d = {_POOLER_ALIASES.get(k, k): v for k, v in d.items()}
    for k in d:
        if k in _POOLER_REFUSED:
            raise V.not_supported(f"pooler_config.{k}", d[k])
        if k not in _POOLER_KEYS:
            raise ValueError(f"pooler_config has an unknown key {k!r}; valid keys: {list(_POOLER_KEYS)}")
    pt = d.get("pooling_type")
    if pt is not None:
        if not isinstance(pt, str) or pt.upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type={pt!r} is not valid; valid values: {list(POOLING_TYPES)}")
        d["pooling_type"] = pt.upper()
    for k in ("normalize", "use_activation"):
        V.boolean(f"pooler_config.{k}", d.get(k), allow_none=True)
    V.optional_integer("pooler_config.dimensions", d.get("dimensions"), minimum=1)
    return PoolerConfig(**d)


@dataclass(frozen=True)
class SentenceTransformersInfo:
    """What a checkpoint's sentence-transformers files say (None / empty: not said)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None  # sentence_bert_config.json: the context sentence-transformers truncates to
    do_lower_case: bool = False  # sentence_bert_config.json: texts lower-cased before tokenizing


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def read_sentence_transformers(folder: str) -> SentenceTransformersInfo:
    """modules.json (its Pooling module's mode, a Normalize module), config_sentence_transformers.json
    (instruction prompts) and sentence_bert_config.json (max_seq_length, do_lower_case) of a checkpoint folder;
    modules we would not run (Dense, ...) are refused."""
    if not os.path.isdir(folder):
        return SentenceTransformersInfo()
    modules = _read_json(os.path.join(folder, "modules.json"))
    pooling_type = normalize = None
    if modules is not None:
        if not isinstance(modules, list):
            raise ValueError(f"{folder}/modules.json must be a list of modules")
        normalize = False
        for m in modules:
            kind = str(m.get("type", "")).rsplit(".", 1)[-1]
            if kind not in _ST_MODULES_SERVED:
                raise V.not_supported("sentence-transformers module", kind,
                                      f"modules.json lists {m.get('type')!r}; served: {list(_ST_MODULES_SERVED)}")
            if kind == "Normalize":
                normalize = True
            elif kind == "Pooling":
                cfg = _read_json(os.path.join(folder, m.get("path", ""), "config.json")) or {}
                on = [mode for mode in cfg if cfg[mode] is True and mode.startswith("pooling_mode_")]
                if len(on) != 1 or on[0] not in _ST_MODES:
                    raise V.not_supported("sentence-transformers pooling", on,
                                          f"one of {sorted(_ST_MODES)} (in {m.get('path')}/config.json)")
                pooling_type = _ST_MODES[on[0]]
    st = _read_json(os.path.join(folder, "config_sentence_transformers.json")) or {}
    prompts = {k: v for k, v in (st.get("prompts") or {}).items() if isinstance(v, str)}
    default = st.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ValueError(f"config_sentence_transformers.json: default_prompt_name {default!r} is not among its "
                         f"prompts {sorted(prompts)}")
    bert = _read_json(os.path.join(folder, "sentence_bert_config.json")) or {}
    max_seq = bert.get("max_seq_length")
    if max_seq is not None and (not isinstance(max_seq, int) or isinstance(max_seq, bool) or max_seq < 1):
        raise ValueError(f"{folder}/sentence_bert_config.json: max_seq_length must be a positive integer, "
                         f"got {max_seq!r}")
    return SentenceTransformersInfo(pooling_type, normalize, prompts, default, max_seq,
                                    bool(bert.get("do_lower_case", False)))


def resolve_runner(runner: str, convert: str, task: str | None, architectures: tuple[str, ...]) -> tuple[str, str]:
    """(runner, convert): "generate" / "pooling", and "none" / "embed" / "classify"; refused combinations raise."""
    V.choice("runner", runner, RUNNERS)
    V.choice("convert", convert, CONVERTS)
    if task is not None:
        V.choice("task", task, tuple(TASKS))
        t_runner, t_convert = TASKS[task]
        if (runner != "auto" and t_runner and runner != t_runner) or (convert != "auto" and t_convert
                                                                      and convert != t_convert):
            raise ValueError(f"task={task!r} contradicts runner={runner!r} / convert={convert!r}; give one of them")
        runner = t_runner or runner
        convert = t_convert or convert
    arch = next(iter(architectures), "")
    native = "classify" if arch.endswith("ForSequenceClassification") else \
        "embed" if arch.endswith("Model") and not arch.endswith("ForCausalLM") else None
    if convert in ("embed", "classify"):
        if runner == "generate":
            raise ValueError(f"convert={convert!r} needs runner='pooling' (or 'auto'), got runner='generate'")
        return "pooling", convert
    if runner == "generate" or (runner == "auto" and native is None):
        if native is not None:
            raise ValueError(f"{arch} is a pooling model ({native}); it cannot run with runner='generate'")
        return "generate", "none"
    if convert == "none" and native is None:
        raise ValueError(f"{arch} needs convert='embed' or 'classify' to run with runner='pooling'")
    return "pooling", native or "embed"


@dataclass(frozen=True)
class PoolingSetup:
    """The resolved pooler of a pooling engine."""

    task: str  # "embed" or "classify"
    pooling_type: str  # one of POOLING_TYPES
    normalize: bool  # embeddings' default (a request's `normalize` overrides it)
    use_activation: bool  # classify / score: softmax (several labels) or sigmoid (one)
    dimensions: int | None  # embeddings' default Matryoshka size (None: the whole hidden state)
    matryoshka: bool | tuple[int, ...]  # whether requests may ask for `dimensions` (tuple: the sizes allowed)
    hidden_size: int
    num_labels: int  # classify: the head's outputs
    prompts: dict[str, str] = field(default_factory=dict)  # sentence-transformers' instruction prompts
    default_prompt: str = ""  # prepended to text inputs (config_sentence_transformers' default_prompt_name)
    # classify from a causal LM's token logits (config.json classifier_from_token, e.g. Qwen3-Reranker's
    # ["no", "yes"]): those tokens' ids (engine/resolve.py looks them up in the tokenizer).
    classifier_token_ids: tuple[int, ...] = ()
    labels: tuple[str, ...] = ()  # classify: each output's name (config.json id2label)
    # A bidirectional encoder (BERT, XLM-RoBERTa): each prompt must run whole in one step (no K/V to segment by).
    bidirectional: bool = False
    max_seq_length: int | None = None  # sentence_bert_config.json's: caps the context (engine/resolve.py)
    do_lower_case: bool = False  # sentence_bert_config.json's

    def text_prompt(self, text: str) -> str:
        """A text input as sentence-transformers encodes it: the default prompt before it, lower-cased when the
        checkpoint says so."""
        text = self.default_prompt + text
        return text.lower() if self.do_lower_case else text

    def describe(self) -> str:
        what = f"{self.num_labels} label(s), activation {'on' if self.use_activation else 'off'}" \
            if self.task == "classify" else f"normalize={self.normalize}, dimensions={self.dimensions or 'all'}"
        return f"Pooling model: task {self.task}, {self.pooling_type} pooling, {what}"


def resolve_pooling(convert: str, given: PoolerConfig | None, st: SentenceTransformersInfo, hf_config) -> PoolingSetup:
    """The pooler of a model converted for `convert`: --pooler-config, else the sentence-transformers files,
    else the defaults (decoders: the last token; embeddings normalized)."""
    given = given or PoolerConfig()
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    hidden = int(text.hidden_size)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka: bool | tuple[int, ...] = tuple(dims) if dims else bool(getattr(hf_config, "is_matryoshka", False))
    pooling_type = given.pooling_type or st.pooling_type or "LAST"
    normalize = given.normalize if given.normalize is not None else st.normalize if st.normalize is not None \
        else convert == "embed"
    if given.dimensions is not None:
        if convert != "embed":
            raise ValueError("pooler_config.dimensions applies to embedding models (convert='embed')")
        check_dimensions(given.dimensions, matryoshka, hidden, "pooler_config.dimensions")
    num_labels = int(getattr(hf_config, "num_labels", 1) or 1) if convert == "classify" else 0
    if convert == "classify" and getattr(hf_config, "classifier_from_token", None):
        num_labels = 1 if len(hf_config.classifier_from_token) == 2 else len(hf_config.classifier_from_token)
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = tuple(str(id2label.get(i, id2label.get(str(i), i))) for i in range(num_labels))
    return PoolingSetup(convert, pooling_type, bool(normalize),
                        True if given.use_activation is None else given.use_activation, given.dimensions,
                        matryoshka, hidden, num_labels, dict(st.prompts),
                        st.prompts.get(st.default_prompt_name, "") if st.default_prompt_name else "",
                        labels=labels, max_seq_length=st.max_seq_length, do_lower_case=st.do_lower_case)
