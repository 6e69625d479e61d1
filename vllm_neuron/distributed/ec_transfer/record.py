"""One media item's embeddings as bytes that carry their own proof of what they are (pure).

Why one request's embeddings can never be served to another: an item is keyed by `ec_key(mm_hash,
model_id)`. `mm_hash` (multimodal/inputs.py's `media_hash`) is a SHA-256 of the modality, the patch grid and the
processed pixel rows: the media bytes after every processor setting that shapes the embedding (resize bounds,
patch and merge size, normalisation, the frames a video samples), so two requests share a key only when the
tower would see the very same input. `model_id` is a SHA-256 of the checkpoint's config (the vision tower's
architecture and the token ids) and its weight files' names and sizes, so an encoder serving another model or
another revision writes other keys. A record repeats its key, mm_hash and model id in its header, gives the
shape and dtype of both tensors and a SHA-256 of the tensor bytes; the reader checks all of them against what it
asked for and what it got. Any mismatch (another key, a truncated or corrupted file, a stale model) is a miss,
so the consumer computes the item itself or fails the request: never a wrong embedding.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct

import torch

from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

MAGIC = b"VNEC1\0"
_DTYPES = {str(dt).removeprefix("torch."): dt for dt in (torch.float32, torch.bfloat16, torch.float16)}


class ECTransferError(RuntimeError):
    """An embedding could not be written or read (full disk, unreachable producer): the request's error."""


def model_identity(hf_config_dict: dict, model_path: str) -> str:
    """SHA-256 of the model's config (minus where it was loaded from) and its weight files' names and sizes."""
    config = {k: v for k, v in hf_config_dict.items() if k not in ("_name_or_path", "transformers_version")}
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    if os.path.isdir(model_path):
        for name in sorted(os.listdir(model_path)):
            if name.endswith((".safetensors", ".bin", ".gguf")):
                h.update(f"{name}:{os.path.getsize(os.path.join(model_path, name))};".encode())
    return h.hexdigest()


def ec_key(mm_hash: str, model_id: str) -> str:
    return hashlib.sha256(f"{model_id}/{mm_hash}".encode()).hexdigest()


def _payload(embeds: torch.Tensor, deepstack: torch.Tensor) -> tuple[bytes, bytes]:
    as_bytes = [t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() for t in (embeds, deepstack)]
    return as_bytes[0], as_bytes[1]


def encode_record(mm_hash: str, model_id: str, embeds: torch.Tensor, deepstack: torch.Tensor) -> bytes:
    """MAGIC, the header's length (u32), the JSON header, then the embeds' and the deepstack's bytes."""
    if embeds.dtype != deepstack.dtype or str(embeds.dtype).removeprefix("torch.") not in _DTYPES:
        raise ValueError(f"embeddings of dtype {embeds.dtype} / {deepstack.dtype} cannot be recorded")
    e, d = _payload(embeds, deepstack)
    header = {"key": ec_key(mm_hash, model_id), "mm_hash": mm_hash, "model": model_id,
              "dtype": str(embeds.dtype).removeprefix("torch."), "embeds": list(embeds.shape),
              "deepstack": list(deepstack.shape), "sha256": hashlib.sha256(e + d).hexdigest()}
    blob = json.dumps(header, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(blob)) + blob + e + d


def decode_record(data: bytes | memoryview, mm_hash: str, model_id: str,
                  where: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(embeds, deepstack) of a record, or None (logged) unless every check passes (module docstring)."""
    data = memoryview(data)
    try:
        if bytes(data[:len(MAGIC)]) != MAGIC:
            raise ValueError("not an embedding record")
        (n,) = struct.unpack("<I", data[len(MAGIC):len(MAGIC) + 4])
        start = len(MAGIC) + 4
        header = json.loads(bytes(data[start:start + n]))
        payload = data[start + n:]
        expected = {"key": ec_key(mm_hash, model_id), "mm_hash": mm_hash, "model": model_id}
        wrong = [k for k, v in expected.items() if header.get(k) != v]
        if wrong:
            raise ValueError(f"its {', '.join(wrong)} differ(s) from the request's")
        dtype = _DTYPES[header["dtype"]]
        shapes = [tuple(int(x) for x in header["embeds"]), tuple(int(x) for x in header["deepstack"])]
        sizes = [dtype.itemsize * int(torch.Size(s).numel()) for s in shapes]
        if sum(sizes) != len(payload):
            raise ValueError(f"{len(payload)} bytes of tensors, the header announces {sum(sizes)}")
        if hashlib.sha256(payload).hexdigest() != header["sha256"]:
            raise ValueError("the tensor bytes do not match their digest")
    except (ValueError, KeyError, TypeError, struct.error) as e:
        logger.warning("Embedding record %s of media %s refused (%s): treated as a miss", where, mm_hash[:16], e)
        return None
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    embeds = raw[:sizes[0]].view(dtype).view(shapes[0])
    deepstack = raw[sizes[0]:].view(dtype).view(shapes[1])
    return embeds, deepstack
