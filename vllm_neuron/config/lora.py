"""LoRA options (vLLM's names): --enable-lora, --max-loras, --max-lora-rank, --max-cpu-loras and the server's
--lora-modules in both of vLLM's forms, `name=path` and `{"name": ..., "path": ..., "base_model_name": ...}`
(pure)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vllm_neuron.config import validate as V

MAX_LORA_RANK_LIMIT = 512  # vLLM's largest --max-lora-rank


@dataclass(frozen=True)
class LoRAModulePath:
    """One adapter the server registers at start: its served name, PEFT folder and parent model name."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True)
class LoRAConfig:
    """The resolved limits: adapters resident on the device (slots), their largest rank, adapters kept in host
    memory."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int


def _module(entry: Any) -> LoRAModulePath:
    if isinstance(entry, LoRAModulePath):
        return entry
    if isinstance(entry, str) and entry.lstrip().startswith("{"):
        try:
            entry = json.loads(entry)
        except json.JSONDecodeError as e:
            raise ValueError(f"lora_modules entry {entry!r} is not valid JSON: {e}") from None
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"lora_modules entry {entry!r} has unknown keys {unknown}; valid keys: name, path, "
                             "base_model_name")
        name, path, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
    elif isinstance(entry, str) and "=" in entry:
        name, path = entry.split("=", 1)
        base = None
    else:
        raise ValueError(f"lora_modules entry {entry!r} must be name=path or a JSON object "
                         '{"name": ..., "path": ..., "base_model_name": ...}')
    for key, value in (("name", name), ("path", path)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"lora_modules entry {entry!r}: {key} must be a non-empty string")
    if base is not None and (not isinstance(base, str) or not base):
        raise ValueError(f"lora_modules entry {entry!r}: base_model_name must be a non-empty string")
    return LoRAModulePath(name.strip(), path.strip(), base)


def parse_lora_modules(value: Any) -> tuple[LoRAModulePath, ...]:
    """--lora-modules entries -> LoRAModulePath, names unique."""
    if value is None:
        return ()
    if isinstance(value, (str, dict, LoRAModulePath)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"lora_modules must be a list of name=path strings or JSON objects, got {value!r}")
    modules = tuple(_module(e) for e in value)
    names = [m.name for m in modules]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"lora_modules names must be unique; repeated: {dup}")
    return modules


def check_lora_options(enable_lora: Any, lora_modules: Any, max_loras: Any, max_lora_rank: Any,
                       max_cpu_loras: Any) -> tuple[LoRAConfig | None, tuple[LoRAModulePath, ...]]:
    """(the limits, or None with LoRA off; the parsed modules)."""
    V.boolean("enable_lora", enable_lora)
    modules = parse_lora_modules(lora_modules)
    if not enable_lora:
        if modules:
            raise ValueError("lora_modules needs enable_lora=True (--enable-lora)")
        return None, ()
    loras = V.integer("max_loras", max_loras, minimum=1)
    rank = V.integer("max_lora_rank", max_lora_rank, minimum=1, maximum=MAX_LORA_RANK_LIMIT)
    cpu = V.optional_integer("max_cpu_loras", max_cpu_loras, minimum=1)
    if cpu is not None and cpu < loras:
        raise ValueError(f"max_cpu_loras={cpu} must be at least max_loras={loras} (every adapter resident on the "
                         "device is also kept in host memory)")
    return LoRAConfig(loras, rank, loras if cpu is None else cpu), modules
