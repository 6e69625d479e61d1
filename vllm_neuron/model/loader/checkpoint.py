"""A model checkpoint on local disk: where it is, its config, and its weights by HF name."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

import torch

from vllm_neuron.model.loader import gguf_cache, gguf_split, safetensors_loader
from vllm_neuron.model.loader.bundled import bundled_model_path

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# generation_config.json bookkeeping that is not a generation setting
_GENERATION_CONFIG_SKIP = {"transformers_version", "_from_model_config", "_source"}
BUNDLED_GENERATION_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bundled_generation_config.json")


@dataclass
class Checkpoint:
    path: str  # resolved local path: a model directory or a .gguf file
    hf_config: "PretrainedConfig"
    generation_config: dict[str, Any] = field(default_factory=dict)
    tokenizer_path: str = ""  # what to pass to load_tokenizer
    gguf_file: str | None = None  # absolute path of the .gguf file for GGUF checkpoints

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def gguf_files(self) -> list[str]:
        """Every file of a GGUF checkpoint: gguf_file, and the later parts of a split one; [] for HF folders."""
        return gguf_split.sibling_parts(self.gguf_file) if self.gguf_file is not None else []

    def iter_weights(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields (hf_parameter_name, tensor) with transformers' names and layouts
        (e.g. 'model.layers.0.self_attn.q_proj.weight'; 'lm_head.weight' only if stored, i.e. not
        for tied embeddings). GGUF tensors are dequantized (or read from the GGUF conversion
        cache); floating tensors are cast to `dtype` when given (integer/float8 quantized payloads
        of safetensors keep their type)."""
        if self.gguf_file is not None:
            return gguf_cache.iter_weights(self.gguf_file, self.hf_config, dtype)
        return safetensors_loader.iter_safetensors_weights(self.path, dtype)

    def weight_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of the weights as iter_weights(dtype) yields them, read from file headers only
        (for a GGUF: dequantized size, float32 for quantized tensors unless `dtype` is given)."""
        if self.gguf_file is not None:
            return gguf_cache.weight_bytes(self.gguf_file, dtype)
        return safetensors_loader.safetensors_weight_bytes(self.path, dtype)


def resolve_model_path(model: str | None) -> str:
    """None -> the bundled SmolLM2 GGUF; a local directory or .gguf file -> its absolute path."""
    if model is None:
        return bundled_model_path()
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a local path or None, got {type(model).__name__}")
    path = os.path.abspath(os.path.expanduser(os.fspath(model)))
    if os.path.isdir(path):
        return path
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return path
        raise ValueError(
            f"model {model!r} is a file but not a .gguf file; pass a .gguf file or a Hugging Face "
            f"style directory (config.json, *.safetensors, tokenizer files)"
        )
    from vllm_neuron.model.loader.hub import parse_hub_id

    if parse_hub_id(os.fspath(model)) is not None:
        raise ValueError(
            f"model {model!r} is not a local path. As a Hugging Face id it is downloaded where the engine's options "
            f"are resolved (LLM(model=...), vllm-neuron serve / generate / compile), not by the checkpoint loader: "
            f"pass the id there, or a local folder or .gguf file here."
        )
    raise ValueError(
        f"model {model!r} does not exist locally and is not a Hugging Face id (org/name, org/name:QUANT). Pass a "
        f"local Hugging Face style directory (config.json, *.safetensors, tokenizer files), a .gguf file, a "
        f"Hugging Face id, or nothing for the bundled SmolLM2 model."
    )


def remote_code_note(model_dir: str) -> str | None:
    """Why the folder's model needs trust_remote_code (its config.json's auto_map), or None."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            auto_map = json.load(f).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return None
    if not auto_map:
        return None
    return (f"it needs trust_remote_code: its config.json's auto_map names the repository's own code "
            f"({', '.join(sorted(set(map(str, auto_map.values())))[:3])}), and vllm-neuron never runs a model's code; "
            "serve an architecture it implements (see the README's table)")


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return {k: v for k, v in data.items() if k not in _GENERATION_CONFIG_SKIP}


def _read_generation_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "generation_config.json")
    return _read_json(path) if os.path.isfile(path) else {}


def _load_gguf(path: str) -> Checkpoint:
    path = gguf_split.first_part(path)  # any part of a split GGUF: the first holds the metadata
    config, generation_config = gguf_cache.load_configs(path)
    return Checkpoint(
        path=path,
        hf_config=config,
        generation_config=generation_config,
        tokenizer_path=path,
        gguf_file=path,
    )


def _load_hf_dir(path: str) -> Checkpoint:
    from transformers import AutoConfig

    # Fail on pickle-only or empty directories now, not at the first weight read.
    safetensors_loader.list_safetensors_files(path)
    remote = remote_code_note(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"Cannot read config.json of model directory {path}: {remote or e}") from e
    return Checkpoint(
        path=path,
        hf_config=config,
        generation_config=_read_generation_config(path),
        tokenizer_path=path,
        gguf_file=None,
    )


def load_checkpoint(model: str | None) -> Checkpoint:
    """Config and weight access for `model` (see resolve_model_path); reads no tensor data yet."""
    path = resolve_model_path(model)
    if model is None:
        ckpt = _load_gguf(path)
        # The GGUF carries no sampling metadata; the authors' recommendation ships beside this module.
        ckpt.generation_config.update(_read_json(BUNDLED_GENERATION_CONFIG))
        return ckpt
    if os.path.isfile(path):
        return _load_gguf(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return _load_hf_dir(path)
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1 or gguf_split.one_split_set(ggufs):
        return _load_gguf(ggufs[0])
    if ggufs:
        raise ValueError(
            f"model directory {path} has no config.json and several .gguf files "
            f"({', '.join(os.path.basename(g) for g in ggufs)}); pass one .gguf file (the first part of a split one)"
        )
    raise ValueError(
        f"model directory {path} has neither config.json (Hugging Face layout) nor a .gguf file"
    )
