"""Building and loading the custom CPU kernels' shared object, once per machine and CPU class.

The object lands in `<cache root>/kernels/<digest>/`; the digest covers the sources, torch's version, the
build variant and its flags, the compiler and the CPU's instruction set, so a `-march=native` build never
reaches another CPU through a shared cache root. A cold build compiles every source at once (the first start
waits for the slowest source, not the sum) and logs each source as it finishes.
"""
from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from vllm_neuron import envs
from vllm_neuron.config.device import compiler_id, cpu_isa
from vllm_neuron.logger import init_logger
from vllm_neuron.model.layers.kernels.ops import register_fakes

logger = init_logger(__name__)

SOURCES = ("op_registry.cpp", "paged_attention.cpp", "linear_bf16.cpp", "linear_quant.cpp", "quant_unpack.cpp", "linear_amx.cpp", "linear_dot_tiles.cpp",
           "linear_int4_tiles.cpp", "linear_int8_tiles.cpp", "sampler.cpp", "activation.cpp", "linear_tile_copies.cpp", "lora.cpp")
HEADERS = ("simd.h", "attention_tiles.h", "int8_vnni.h", "int_dot.h", "int_dot_avx2.h", "int4_vnni.h", "int4_table.h", "online_softmax.h", "amx_tiles.h",
           "attention_bf16.h", "attention_shared_packs.h", "attention_fp32_tiles.h", "attention_amx.h", "attention_decode.h", "attention_split.h", "cache_elems.h",
           "tile_linear_args.h", "int8_acts.h", "op_isa.h", "op_table.h")
_FLAGS = ("-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-fPIC", "-std=c++17")
# Per source, after _FLAGS: the sampler divides by the temperature as torch does (no x * (1 / t)), so a row's
# scaled logits are the host sampler's to the bit.
_SOURCE_FLAGS = {"sampler.cpp": ("-fno-reciprocal-math",)}
# CPU class -> target flags. avx2 is x86-64-v3 (Haswell and later, Zen 1 and later), so a forced avx2
# build on an AVX-512 machine has no AVX-512 code in it.
VARIANTS = {
    "avx512bf16": ("-march=native",),
    "avx2": ("-march=x86-64-v3", "-mtune=generic"),
    "generic": ("-march=native",) if platform.machine() not in ("x86_64", "AMD64") else ("-march=x86-64",),
}
# What a cold build took on 2 cores (the slowest source bounds it), for the log's expectation.
_EXPECTED_BUILD_SECONDS = 60
_HERE = Path(__file__).resolve().parent
_LINK_FLAGS = ("-Wl,-z,defs",) if sys.platform.startswith("linux") else ()


def _build_dir(digest: str) -> Path:
    return Path(envs.VLLM_NEURON_KERNEL_CACHE_DIR or Path(envs.VLLM_CACHE_ROOT) / "kernels") / digest


def cxx() -> str:
    return os.environ.get("CXX", "g++")


def digest(variant: str) -> str:
    """The build's cache key for `variant` (see the module's docstring)."""
    h = hashlib.sha256()
    for s in SOURCES + HEADERS:
        h.update((_HERE / s).read_bytes())
    h.update(torch.__version__.encode())
    h.update(" ".join((*_FLAGS, variant, *VARIANTS[variant])).encode())
    h.update(repr(sorted(_SOURCE_FLAGS.items())).encode())
    h.update(compiler_id(cxx()).encode())
    h.update(cpu_isa().encode())
    return h.hexdigest()[:16]


def compile_command(source: str, obj: str, target: tuple[str, ...]) -> list[str]:
    """The compiler's command line for one of SOURCES into the object `obj`, for the target flags `target`
    (a VARIANTS value, or any -march a test wants to check the sources against)."""
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [cxx(), *_FLAGS, *_SOURCE_FLAGS.get(source, ()), *target, abi, *includes, "-c", str(_HERE / source),
            "-o", obj]


def _compile(out: Path, variant: str) -> None:
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Building the custom CPU kernels, %s build (once per machine and CPU class): %d sources in "
                "parallel, about %d s on 2 cores; into %s", variant, len(SOURCES), _EXPECTED_BUILD_SECONDS,
                out.parent)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        objects = [os.path.join(work, s + ".o") for s in SOURCES]
        procs = {s: subprocess.Popen(compile_command(s, o, VARIANTS[variant]), stderr=subprocess.PIPE, text=True)
                 for s, o in zip(SOURCES, objects)}
        pending, done = dict(procs), 0
        while pending:
            for s, p in list(pending.items()):
                if p.poll() is None:
                    continue
                err = p.stderr.read()
                if p.returncode:
                    for q in pending.values():
                        q.kill()
                    raise RuntimeError(f"{cxx()} failed ({p.returncode}) on {s}: {err.strip()[-2000:]}")
                done += 1
                del pending[s]
                logger.info("Kernel source %d/%d built: %s (%.0f s)", done, len(SOURCES), s, time.perf_counter() - t0)
            time.sleep(0.2)
        tmp = os.path.join(work, "vllm_neuron_kernels.so")
        # -z defs: an op op_registry.cpp registers but no source defines fails here, not when the library loads.
        link = subprocess.run([cxx(), "-shared", "-fopenmp", *objects, "-o", tmp, f"-L{torch_lib}", "-ltorch_cpu",
                               "-lc10", f"-Wl,-rpath,{torch_lib}", *_LINK_FLAGS], capture_output=True, text=True)
        if link.returncode:
            raise RuntimeError(f"{cxx()} failed ({link.returncode}) linking: {link.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent starts never load a half-written library
    logger.info("Custom CPU kernels built in %.0f s", time.perf_counter() - t0)


@functools.lru_cache(maxsize=None)
def load(variant: str) -> bool:
    """Builds (on first use) and loads the `variant` build's ops; False, logged once, when that fails: the
    layers then take their torch paths."""
    try:
        so = _build_dir(digest(variant)) / "vllm_neuron_kernels.so"
        if not so.exists():
            so.parent.mkdir(parents=True, exist_ok=True)
            # Processes starting together on a fresh machine (DP replicas, TP ranks) build once: the others
            # wait for the first one's library instead of compiling the same sources beside it.
            with open(so.parent / ".build.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not so.exists():
                    _compile(so, variant)
        torch.ops.load_library(str(so))
    except Exception as e:  # noqa: BLE001 - the torch paths are always there
        logger.warning("Custom CPU kernels unavailable, using the torch paths: %s", e)
        return False
    register_fakes()
    return True
