"""`--generation-config` and `--override-generation-config`: default sampling parameters, as in vLLM.

`auto` (default): the model's generation_config.json (for the bundled model, the one shipped beside
it, bundled_generation_config.json); `vllm`: vLLM's neutral defaults (temperature 1, top_p 1, ...,
max_tokens up to the context); a folder: its generation_config.json. The override JSON is applied on
top. A request's own fields always win; the defaults only fill fields it leaves unset (pure).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from vllm_neuron.config.json_object import parse_json_object

# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param).
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GENERATION_CONFIG_HELP = ("'auto': the model's generation_config.json (the bundled model ships one: temperature "
                          "0.2, top_p 0.9, max_new_tokens 256); 'vllm': vLLM's neutral defaults; or a folder "
                          "holding a generation_config.json")


def check_generation_config_arg(value: str) -> None:
    """Raises a ValueError naming the option unless value is auto, vllm or a folder with the file."""
    if value in ("auto", "vllm"):
        return
    if not isinstance(value, str) or not os.path.isfile(os.path.join(value, "generation_config.json")):
        raise ValueError(f"generation_config={value!r} is not valid: choose 'auto', 'vllm', or a folder that "
                         "holds a generation_config.json")


def parse_override(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """--override-generation-config: a JSON object of generation_config keys vLLM reads for sampling."""
    value = parse_json_object(value, "override_generation_config is not valid JSON: {error}",
                              "override_generation_config must be a JSON object, got {type}")
    unknown = sorted(set(value) - set(SAMPLING_KEYS))
    if unknown:
        raise ValueError(f"override_generation_config keys {unknown} are not used; valid keys: {sorted(SAMPLING_KEYS)}")
    return dict(value)


def read_generation_config(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "generation_config.json"), encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{folder}/generation_config.json is not a JSON object")
    return data


def effective_generation_config(spec: str, model_config: Mapping[str, Any],
                                override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The generation config whose sampling keys become request defaults. Token ids (eos, ...) always
    come from the model's own config; only the sampling keys follow `spec`."""
    check_generation_config_arg(spec)
    out = {k: v for k, v in model_config.items() if k not in SAMPLING_KEYS}
    if spec == "auto":
        source: Mapping[str, Any] = model_config
    elif spec == "vllm":
        source = {}
    else:
        source = read_generation_config(spec)
    out.update({k: v for k, v in source.items() if k in SAMPLING_KEYS})
    out.update(override or {})
    return out


def sampling_defaults(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword defaults from a generation config (max_new_tokens -> max_tokens)."""
    return {field: generation_config[key] for key, field in SAMPLING_KEYS.items()
            if generation_config.get(key) is not None}
