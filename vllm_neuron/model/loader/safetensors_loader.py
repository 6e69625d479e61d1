"""Weights of a Hugging Face style directory: single or sharded safetensors files."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth")

# safetensors header dtype strings -> bytes per element (read without loading any tensor)
_HEADER_ITEMSIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
    "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "F4": 1,
}
_HEADER_FLOAT = {"F64", "F32", "F16", "BF16"}


def list_safetensors_files(model_dir: str) -> list[str]:
    """The safetensors files holding the model's weights, in a stable order.

    The index file wins when present (it may leave out stray files such as a consolidated copy).
    A directory with only pickled (.bin/.pt) weights is refused: loading pickles runs arbitrary code.
    """
    index = os.path.join(model_dir, INDEX_NAME)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(model_dir, n))]
        if missing:
            raise ValueError(
                f"{index} lists shards that are missing from {model_dir}: {', '.join(missing)}"
            )
        if names:
            return [os.path.join(model_dir, n) for n in names]
    single = os.path.join(model_dir, SINGLE_NAME)
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    pickles = sorted(
        os.path.basename(p) for pat in _PICKLE_PATTERNS for p in glob.glob(os.path.join(model_dir, pat))
    )
    if pickles:
        raise ValueError(
            f"Model directory {model_dir} has only PyTorch pickle weights ({', '.join(pickles[:4])}); "
            f"only safetensors checkpoints are supported. Convert it, e.g. load it with transformers "
            f"and call save_pretrained(dir) (safetensors is the default format)."
        )
    raise ValueError(f"Model directory {model_dir} has no *.safetensors weight files.")


def _should_cast(t_dtype: torch.dtype) -> bool:
    # Quantized payloads (ints, float8 with separate scales) must keep their stored type.
    return t_dtype.is_floating_point and t_dtype.itemsize >= 2


def iter_safetensors_weights(
    model_dir: str, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) for every tensor of every file, cast to `dtype` when given.

    Integer and float8 tensors (quantized data, scales stored as such) are never cast.
    """
    for path in list_safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if dtype is not None and t.dtype != dtype and _should_cast(t.dtype):
                    t = t.to(dtype)
                yield name, t


def _read_header(path: str) -> dict:
    # The header is an 8-byte little-endian length followed by JSON: no tensor data is touched.
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def safetensors_weight_bytes(model_dir: str, dtype: torch.dtype | None = None) -> int:
    """Bytes of all tensors as iter_safetensors_weights(model_dir, dtype) would yield them."""
    total = 0
    for path in list_safetensors_files(model_dir):
        for name, info in _read_header(path).items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in info["shape"]:
                numel *= int(d)
            kind = info["dtype"]
            if dtype is not None and kind in _HEADER_FLOAT:
                total += numel * dtype.itemsize
            else:
                total += numel * _HEADER_ITEMSIZE.get(kind, 1)
    return total
