"""PEFT LoRA adapter folders (`adapter_config.json` + `adapter_model.safetensors`), read and checked against
the base model's projections.

`inspect_adapter` checks a folder from its config and the safetensors header alone (no tensor data read): the
server runs it when an adapter is registered, the engine's front end before a request is admitted.
`load_adapter` then reads the tensors, each module's scaling (lora_alpha / r, or / sqrt(r) with rsLoRA)
folded into B. Every refusal is one ValueError naming the folder and the first thing that does not fit.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: q/k/v/o of attention and the gated MLP's three.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT drops the adapter name when saving)
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class BaseShapes:
    """The base model's LoRA-able projections: per name (in_features, out_features), unsharded."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def from_hf_config(cls, hf_config) -> BaseShapes:
        t = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        h, nh = t.hidden_size, t.num_attention_heads
        nkv = getattr(t, "num_key_value_heads", None) or nh
        hd = getattr(t, "head_dim", None) or h // nh
        inter = t.intermediate_size
        return cls(t.num_hidden_layers, {
            "q_proj": (h, nh * hd), "k_proj": (h, nkv * hd), "v_proj": (h, nkv * hd), "o_proj": (nh * hd, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)})


@dataclass(frozen=True)
class AdapterInfo:
    """What inspecting a folder found: its rank, scaling and the (layer, projection) pairs it adapts."""

    path: str
    rank: int
    scaling: float
    modules: tuple[tuple[int, str], ...]


@dataclass
class LoRAWeights:
    """A loaded adapter: per (layer, projection) A [r, in] and B [out, r] with the scaling folded in (fp32)."""

    info: AdapterInfo
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _fail(path: str, why: str) -> ValueError:
    return ValueError(f"LoRA adapter {path!r}: {why}")


def read_adapter_config(path: str) -> dict:
    if not isinstance(path, str) or not os.path.isdir(path):
        raise _fail(path, "not an existing folder (a PEFT adapter folder holds adapter_config.json and "
                          "adapter_model.safetensors)")
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path):
        raise _fail(path, f"no {CONFIG_FILE} in the folder (not a PEFT adapter)")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(path, f"{CONFIG_FILE} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise _fail(path, f"{CONFIG_FILE} must hold a JSON object")
    return cfg


def _check_config(path: str, cfg: dict, max_rank: int) -> tuple[int, float]:
    """(rank, scaling) of a LoRA config that this engine can serve."""
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise _fail(path, f"peft_type {kind!r} is not a LoRA adapter (only LORA is supported)")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _fail(path, f"rank r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise _fail(path, f"rank r={r} is above max_lora_rank={max_rank} (--max-lora-rank); start the engine with "
                          f"--max-lora-rank {r} or more")
    unsupported = {"use_dora": "DoRA (use_dora)", "fan_in_fan_out": "fan_in_fan_out (Conv1D bases)",
                   "lora_bias": "lora_bias (a bias on B)", "target_parameters": "target_parameters (raw parameters)"}
    for key, why in unsupported.items():
        if cfg.get(key):
            raise _fail(path, f"{why} is not supported")
    if cfg.get("bias", "none") not in ("none", None):
        raise _fail(path, f"bias={cfg['bias']!r} is not supported (trained biases); only bias='none'")
    if cfg.get("modules_to_save"):
        raise _fail(path, f"modules_to_save {cfg['modules_to_save']!r} is not supported (fully trained modules "
                          "beside the LoRA matrices)")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _fail(path, f"{key} (per-module ranks or alphas) is not supported yet")
    targets = cfg.get("target_modules")
    names = [targets] if isinstance(targets, str) and targets in TARGETS + _UNSUPPORTED_TARGETS else \
        targets if isinstance(targets, list) else []
    for name in names:
        _check_target(path, name)
    alpha = cfg.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise _fail(path, f"lora_alpha must be a positive number, got {alpha!r}")
    return r, alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _check_target(path: str, name: str) -> None:
    if name in _UNSUPPORTED_TARGETS:
        raise _fail(path, f"target module {name!r} is not supported (adapters on the embeddings or the output "
                          "layer); target the projections " + ", ".join(TARGETS))
    if name not in TARGETS:
        raise _fail(path, f"target module {name!r} is not in the base model (its LoRA targets are "
                          + ", ".join(TARGETS) + ")")


def _weights_file(path: str) -> str:
    f = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(f):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise _fail(path, "adapter_model.bin (a pickle) is not loaded; save the adapter with safetensors "
                              "(PEFT's default, save_pretrained(..., safe_serialization=True))")
        raise _fail(path, f"no {WEIGHTS_FILE} in the folder")
    return f


def _tensor_name(path: str, key: str, num_layers: int) -> tuple[int, str, str]:
    """(layer, projection, "A" or "B") of a checkpoint tensor name."""
    m = _KEY.match(key)
    if m is None:
        for name in _UNSUPPORTED_TARGETS:
            if name in key:
                _check_target(path, name)
        if "lora_magnitude_vector" in key:
            raise _fail(path, "DoRA magnitudes are not supported")
        raise _fail(path, f"tensor {key!r} is not a LoRA matrix of a decoder layer's projection")
    layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
    _check_target(path, module)
    if layer >= num_layers:
        raise _fail(path, f"tensor {key!r} adapts layer {layer}, but the base model has {num_layers} layers")
    return layer, module, ab


def inspect_adapter(path: str, base: BaseShapes, max_rank: int) -> AdapterInfo:
    """Checks the folder against the base model without reading tensor data (see the module docstring)."""
    from safetensors import safe_open

    cfg = read_adapter_config(path)
    rank, scaling = _check_config(path, cfg, max_rank)
    f = _weights_file(path)
    seen: dict[tuple[int, str], set[str]] = {}
    try:
        with safe_open(f, framework="pt") as st:
            for key in st.keys():
                layer, module, ab = _tensor_name(path, key, base.num_layers)
                shape = tuple(st.get_slice(key).get_shape())
                fan_in, fan_out = base.shapes[module]
                want = (rank, fan_in) if ab == "A" else (fan_out, rank)
                if shape != want:
                    raise _fail(path, f"tensor {key!r} has shape {shape}, but the base model's {module} with rank "
                                      f"r={rank} needs {want}")
                seen.setdefault((layer, module), set()).add(ab)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' own error types: a corrupt file is the adapter's fault
        raise _fail(path, f"{WEIGHTS_FILE} cannot be read: {e}") from None
    half = sorted(k for k, v in seen.items() if v != {"A", "B"})
    if half:
        layer, module = half[0]
        raise _fail(path, f"layer {layer} {module} has only lora_{next(iter(seen[half[0]]))} (A and B go together)")
    if not seen:
        raise _fail(path, f"{WEIGHTS_FILE} holds no LoRA matrices")
    return AdapterInfo(path, rank, float(scaling), tuple(sorted(seen)))


def load_adapter(path: str, base: BaseShapes, max_rank: int) -> LoRAWeights:
    """The adapter's matrices in fp32, B scaled (the checks of `inspect_adapter` first)."""
    from safetensors.torch import load_file

    info = inspect_adapter(path, base, max_rank)
    tensors = load_file(_weights_file(path))
    weights: dict[tuple[int, str], list] = {}
    for key, t in tensors.items():
        layer, module, ab = _tensor_name(path, key, base.num_layers)
        if not torch.isfinite(t).all():
            raise _fail(path, f"tensor {key!r} holds NaN or infinite values")
        pair = weights.setdefault((layer, module), [None, None])
        pair[0 if ab == "A" else 1] = t.float() if ab == "A" else t.float() * info.scaling
    return LoRAWeights(info, {k: (a, b) for k, (a, b) in weights.items()})


class AdapterChecker:
    """`inspect_adapter` once per (id, folder): what the front end runs before a request reaches the engine."""

    def __init__(self, base: BaseShapes, max_rank: int) -> None:
        self.base = base
        self.max_rank = max_rank
        self._seen: dict[tuple[int, str], AdapterInfo] = {}

    def check(self, lora_request) -> AdapterInfo:
        key = (lora_request.lora_int_id, lora_request.lora_path)
        info = self._seen.get(key)
        if info is None:
            other = next((p for i, p in self._seen if i == key[0]), None)
            if other is not None:
                raise ValueError(f"LoRA adapter id {key[0]} already names folder {other!r}; give "
                                 f"{lora_request.lora_name!r} ({key[1]!r}) an id of its own")
            info = self._seen[key] = inspect_adapter(lora_request.lora_path, self.base, self.max_rank)
        return info

    def forget(self, lora_request) -> None:
        """Checks its folder again next time (the server unloaded it)."""
        self._seen.pop((lora_request.lora_int_id, lora_request.lora_path), None)
