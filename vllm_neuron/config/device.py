"""`--device auto|cpu|cuda` and `--dtype` resolution."""
from __future__ import annotations

import functools

import torch

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DTYPE_CHOICES = ("auto", "float32", "float", "bfloat16", "float16", "half")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device not in DEVICE_CHOICES:
        raise ValueError(f"device={device!r} is not valid; choose one of {list(DEVICE_CHOICES)}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch sees no CUDA device; use --device cpu or auto")
    return torch.device(device)


@functools.lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmuls run 3-6x faster than fp32 there (FACTS.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported; choose one of {list(DTYPE_CHOICES)}")
        return dtype
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype={dtype!r} is not valid; choose one of {list(DTYPE_CHOICES)}")
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
