"""KV offloading to a second tier: vLLM's `--kv-offloading-size` (GiB) and `--kv-offloading-backend` -> a
`KVOffloadConfig`, and where the tier keeps each block (pure but for the folder check).

On a CPU server the KV pool already lives in host memory, so the second tier is a folder on local disk (NVMe)
or a shared file system: `VLLM_NEURON_KV_OFFLOAD_DIR`, default `$VLLM_CACHE_ROOT/kv_tier`. Every full block the
prefix cache registers is written there once, under its prefix-cache hash (sha256, stable across processes), in
a sub-folder per model, weights and KV layout; a later prompt whose prefix left the pool reads its blocks back
instead of prefilling them. The files outlive the process: a restarted server, or another data-parallel replica
of the same model on the machine, finds them. `native` is the one backend (vLLM's default name); `lmcache` is
refused (LMCache is not integrated).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

from vllm_neuron.config import validate as V

BACKENDS = ("native",)
FILE_SUFFIX = ".kv"


@dataclass(frozen=True)
class KVOffloadConfig:
    size_bytes: int  # the tier's bound, over all tensor-parallel ranks (each rank keeps its share)
    path: str  # the tier's root folder (a sub-folder per model and layout)
    backend: str = "native"

    def describe(self) -> str:
        return f"{self.size_bytes / 2**30:g} GiB in {self.path} (backend {self.backend})"


def parse_kv_offloading(size_gib: Any, backend: Any, path: str) -> KVOffloadConfig | None:
    """The tier the options ask for (None: no offloading). The folder is created and must be writable."""
    if size_gib is None:
        if backend is not None:
            raise ValueError(f"kv_offloading_backend={backend!r} needs kv_offloading_size (the tier's size in GiB)")
        return None
    size = V.number("kv_offloading_size", size_gib, minimum=0.0, min_exclusive=True, from_text=True)
    if backend == "lmcache":
        raise V.not_supported("kv_offloading_backend", backend, "LMCache is not integrated; use 'native' (a folder "
                              "tier, VLLM_NEURON_KV_OFFLOAD_DIR)")
    backend = V.choice("kv_offloading_backend", backend or "native", BACKENDS)
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
            pass
    except OSError as e:
        raise ValueError(f"the KV offloading folder {path} (VLLM_NEURON_KV_OFFLOAD_DIR) is not a writable folder: "
                         f"{e}") from None
    return KVOffloadConfig(int(size * 2**30), path, backend)


def block_file(folder: str, block_hash: bytes, rank: int) -> str:
    """Where tensor-parallel rank `rank` keeps its share of the block whose prefix-cache hash is `block_hash`."""
    name = block_hash.hex()
    return os.path.join(folder, name[:2], f"{name}.r{rank}{FILE_SUFFIX}")
