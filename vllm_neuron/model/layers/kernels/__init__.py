"""The project's custom CPU kernels (the seeds' "NKI kernels" on this backend), built on first use.

Each kernel is C++ registered as a torch custom op (`torch.ops.vllm_neuron.*`) with a fake
implementation, so torch.compile keeps it as one call inside a bucket's graph. The shared object is
compiled once per machine with the system C++ compiler into `<cache root>/kernels/<hash>/` (the hash
covers the source, torch's version, the flags, the compiler and the CPU's instruction set: the
library is built with -march=native, so a cache root shared between machines never hands one CPU
another's build) and reused by every later start.

`VLLM_NEURON_DISABLE_NKI_KERNELS=1` turns them off; so does a non-CPU device or a failed build
(logged once): the layers then take their pure-torch paths, which compute the same thing.
"""
from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch

from vllm_neuron import envs
from vllm_neuron.config.device import compiler_id, cpu_isa
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

_SOURCES = ("paged_attention.cpp", "linear_bf16.cpp")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-shared", "-fPIC", "-std=c++17")


def _build_dir(digest: str) -> Path:
    return Path(envs.VLLM_CACHE_ROOT) / "kernels" / digest


def _compile(out: Path) -> None:
    from torch.utils import cpp_extension

    here = Path(__file__).resolve().parent
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [_cxx(), *_FLAGS, abi, *includes, *[str(here / s) for s in _SOURCES],
           "-o", tmp, f"-L{torch_lib}", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}"]
    logger.info("Building the custom CPU kernels (once per machine) into %s", out.parent)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, out)  # atomic: concurrent starts never load a half-written library


def _digest() -> str:
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for s in _SOURCES:
        h.update((here / s).read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join(_FLAGS).encode())
    h.update(compiler_id(_cxx()).encode())
    h.update(cpu_isa().encode())
    return h.hexdigest()[:16]


def _cxx() -> str:
    return os.environ.get("CXX", "g++")


@functools.lru_cache(maxsize=1)
def _load() -> bool:
    try:
        so = _build_dir(_digest()) / "vllm_neuron_kernels.so"
        if not so.exists():
            _compile(so)
        torch.ops.load_library(str(so))
    except Exception as e:  # noqa: BLE001 - the torch paths are always there
        logger.warning("Custom CPU kernels unavailable, using the torch paths: %s", e)
        return False

    @torch.library.register_fake("vllm_neuron::paged_attention")
    def _(q, k_cache, v_cache, block_tables, query_start, positions, scale, block_size):
        return torch.empty_like(q)

    if _has_op("linear_bf16"):
        @torch.library.register_fake("vllm_neuron::linear_bf16")
        def _(x, w):
            return x.new_empty((x.shape[0], w.shape[0]))

    return True


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.vllm_neuron, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def linear_kernel_available(device: torch.device) -> bool:
    """Whether the bf16 weight-streaming linear is built here (it needs a CPU with AVX512-BF16)."""
    return kernels_enabled(device) and _has_op("linear_bf16")


def kernels_enabled(device: torch.device) -> bool:
    """Whether the custom kernels serve this device (building them on first call)."""
    if envs.VLLM_NEURON_DISABLE_NKI_KERNELS or device.type != "cpu":
        return False
    return _load()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start: torch.Tensor, positions: torch.Tensor, scale: float, block_size: int) -> torch.Tensor:
    """Causal attention of every query row over its sequence's cached keys 0..position.

    q [N, H, D]; caches [slots, KV, D] (the rows' own K/V already written); block_tables [S, n];
    query_start [S + 1] (rows of sequence s: query_start[s]..query_start[s + 1]); positions [N].
    Returns [N, H, D]; rows of no sequence (padding) are 0."""
    return torch.ops.vllm_neuron.paged_attention(q, k_cache, v_cache, block_tables, query_start, positions,
                                                 scale, block_size)


def linear_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 @ w[N, K]^T -> [M, N] bf16, K a multiple of 32; for small M (decode)."""
    return torch.ops.vllm_neuron.linear_bf16(x, w)
