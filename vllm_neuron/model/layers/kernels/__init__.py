"""The project's custom CPU kernels (the seeds' "NKI kernels" on this backend), built on first use.

Each kernel is C++ registered as a torch custom op (`torch.ops.vllm_neuron.*`) with a fake
implementation, so torch.compile keeps it as one call inside a bucket's graph. The shared object is
compiled once per machine with the system C++ compiler into `<cache root>/kernels/<hash>/` (the hash
covers the source, torch's version, the CPU variant and its flags, the compiler and the CPU's instruction
set: -march=native builds must never reach another CPU through a shared cache root) and reused by every
later start.

One build per CPU class (`VARIANTS`), picked from /proc/cpuinfo or forced with VLLM_NEURON_CPU_ISA:
`avx512bf16` (bf16 dot products in hardware), `avx2` (x86-64-v3: AVX2 + FMA; bf16 widened to fp32),
`generic` (baseline x86-64 / other architectures: attention only, compiler-vectorized).

`VLLM_NEURON_DISABLE_NKI_KERNELS=1` turns them off; so does a non-CPU device or a failed build
(logged once): the layers then take their pure-torch paths, which compute the same thing.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch

from vllm_neuron import envs
from vllm_neuron.config.device import compiler_id, cpu_isa
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

_SOURCES = ("paged_attention.cpp", "linear_bf16.cpp", "linear_quant.cpp", "linear_amx.cpp", "linear_dot_tiles.cpp",
            "token_mask.cpp", "activation.cpp", "linear_tile_copies.cpp")
_HEADERS = ("simd.h", "attention_tiles.h", "int8_vnni.h", "online_softmax.h", "amx_tiles.h", "attention_bf16.h",
            "attention_amx.h", "attention_decode.h", "attention_split.h", "cache_elems.h", "tile_linear_args.h")
_FLAGS = ("-O3", "-fopenmp", "-ffast-math", "-fno-finite-math-only", "-fPIC", "-std=c++17")
# CPU class -> target flags. avx2 is x86-64-v3 (Haswell and later, Zen 1 and later), so a forced avx2
# build on an AVX-512 machine has no AVX-512 code in it.
VARIANTS = {
    "avx512bf16": ("-march=native",),
    "avx2": ("-march=x86-64-v3", "-mtune=generic"),
    "generic": ("-march=native",) if platform.machine() not in ("x86_64", "AMD64") else ("-march=x86-64",),
}


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return _cpu_flags()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def detect_variant(flags: set[str]) -> str:
    """The best build this CPU runs (pure)."""
    if "avx512_bf16" in flags and "avx512bw" in flags:
        return "avx512bf16"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "generic"


def choose_variant(flags: set[str], forced: str | None) -> tuple[str, str]:
    """(variant, why): `forced` (VLLM_NEURON_CPU_ISA) when this CPU runs it, else the best it runs (pure)."""
    best = detect_variant(flags)
    if forced is None:
        return best, "detected from /proc/cpuinfo"
    order = list(VARIANTS)  # best first
    if order.index(forced) < order.index(best):
        raise ValueError(f"VLLM_NEURON_CPU_ISA={forced} needs instructions this CPU lacks (best here: {best}); "
                         f"valid values: {', '.join(order[order.index(best):])}")
    return forced, "forced by VLLM_NEURON_CPU_ISA"


@functools.lru_cache(maxsize=1)
def kernel_variant() -> tuple[str, str]:
    """(variant, why) of this process' build."""
    return choose_variant(_cpu_flags(), envs.VLLM_NEURON_CPU_ISA)


def _build_dir(digest: str) -> Path:
    return Path(envs.VLLM_CACHE_ROOT) / "kernels" / digest


def _compile(out: Path) -> None:
    from torch.utils import cpp_extension

    here = Path(__file__).resolve().parent
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    includes = [f"-I{p}" for p in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    out.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Building the custom CPU kernels, %s build (once per machine and CPU class) into %s",
                kernel_variant()[0], out.parent)
    with tempfile.TemporaryDirectory(dir=out.parent) as work:
        # One compiler per source, all at once: the first start waits for the slowest source, not the sum.
        objects = [os.path.join(work, s + ".o") for s in _SOURCES]
        procs = {s: subprocess.Popen([_cxx(), *_FLAGS, *VARIANTS[kernel_variant()[0]], abi, *includes, "-c",
                                      str(here / s), "-o", o], stderr=subprocess.PIPE, text=True)
                 for s, o in zip(_SOURCES, objects)}
        errors = {s: p.communicate()[1] for s, p in procs.items()}
        for s, p in procs.items():
            if p.returncode:
                raise RuntimeError(f"{_cxx()} failed ({p.returncode}) on {s}: {errors[s].strip()[-2000:]}")
        tmp = os.path.join(work, "vllm_neuron_kernels.so")
        link = subprocess.run([_cxx(), "-shared", "-fopenmp", *objects, "-o", tmp, f"-L{torch_lib}", "-ltorch_cpu",
                               "-lc10", f"-Wl,-rpath,{torch_lib}"], capture_output=True, text=True)
        if link.returncode:
            raise RuntimeError(f"{_cxx()} failed ({link.returncode}) linking: {link.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent starts never load a half-written library


def _digest() -> str:
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for s in _SOURCES + _HEADERS:
        h.update((here / s).read_bytes())
    h.update(torch.__version__.encode())
    variant = kernel_variant()[0]
    h.update(" ".join((*_FLAGS, variant, *VARIANTS[variant])).encode())
    h.update(compiler_id(_cxx()).encode())
    h.update(cpu_isa().encode())
    return h.hexdigest()[:16]


def _cxx() -> str:
    return os.environ.get("CXX", "g++")


@functools.lru_cache(maxsize=1)
def _load() -> bool:
    kernel_variant()  # a VLLM_NEURON_CPU_ISA this CPU cannot run is refused here, not fallen back from
    try:
        so = _build_dir(_digest()) / "vllm_neuron_kernels.so"
        if not so.exists():
            _compile(so)
        torch.ops.load_library(str(so))
    except Exception as e:  # noqa: BLE001 - the torch paths are always there
        logger.warning("Custom CPU kernels unavailable, using the torch paths: %s", e)
        return False

    @torch.library.register_fake("vllm_neuron::paged_attention")
    def _(q, k_cache, v_cache, block_tables, query_start, positions, scale, block_size, sinks=None, window=0):
        return torch.empty_like(q)

    @torch.library.register_fake("vllm_neuron::paged_attention_fp8")
    def _(q, k_cache, v_cache, block_tables, query_start, positions, scale, block_size, k_scale, v_scale, sinks=None,
          window=0):
        return torch.empty_like(q)

    for op in ("linear_bf16", "linear_f32"):
        if _has_op(op):
            torch.library.register_fake(f"vllm_neuron::{op}")(_linear_fake)

    for name in ("linear_amx", "linear_dot_tiles"):
        if _has_op(name):
            torch.library.register_fake(f"vllm_neuron::{name}")(lambda x, packed, bias, n: x.new_empty((x.shape[0], n)))
    for name in ("linear_int8", "linear_int4"):
        if _has_op(name):
            torch.library.register_fake(f"vllm_neuron::{name}")(lambda x, q, scale: x.new_empty((x.shape[0], q.shape[0])))
    if _has_op("greedy_argmax"):
        torch.library.register_fake("vllm_neuron::apply_token_bitmask_")(lambda logits, bitmask: None)
        torch.library.register_fake("vllm_neuron::greedy_argmax")(
            lambda logits: logits.new_empty((logits.shape[0],), dtype=torch.long))
    if _has_op("linear_tiles"):
        torch.library.register_fake("vllm_neuron::linear_tiles")(_linear_fake)
    if _has_op("silu_and_mul"):
        torch.library.register_fake("vllm_neuron::silu_and_mul")(
            lambda h: h.new_empty((*h.shape[:-1], h.shape[-1] // 2)))
    if _has_op("unpack_int8"):
        torch.library.register_fake("vllm_neuron::unpack_int8")(lambda q, dtype: q.new_empty(q.shape, dtype=dtype))
        torch.library.register_fake("vllm_neuron::unpack_int4")(
            lambda q, scales, dtype: q.new_empty((q.shape[0], 2 * q.shape[1]), dtype=dtype))

    return True


def _linear_fake(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops.vllm_neuron, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def linear_kernel_dtypes(device: torch.device) -> frozenset[torch.dtype]:
    """The dtypes the weight-streaming linear is built for here (AVX512-BF16: bf16 and fp32; AVX2: the
    same via conversion; generic: none)."""
    if not kernels_enabled(device):
        return frozenset()
    ops = {torch.bfloat16: "linear_bf16", torch.float32: "linear_f32"}
    return frozenset(dt for dt, op in ops.items() if _has_op(op))


def small_batch_rows(variant: str, dtype: torch.dtype) -> int:
    """Up to how many rows the weight-streaming linear serves on this CPU class (pure).

    Measured on the bundled model's linears (one step's worth, 2 cores): on a Xeon with AMX, oneDNN's
    tile path takes bf16 from 5 rows on (kernel 31.7 ms vs oneDNN ~27 ms at 5 rows; with the prefetching
    bands, the kernel led to 8 rows, 25 vs 29 ms, and lost at 16, 43 vs 28: no default decode bucket lies
    between 4 and 16), and our AMX tile kernel on packed weights beat both (packed_weights.py). Without AMX
    the weight-streaming kernel stayed ahead of oneDNN to 32 rows in bf16, but the VDPBF16PS kernel on
    packed weights (linear_dot_tiles.cpp) beat it from 8 rows on (Zen 5 EPYC: 3.6 vs 4.6 ms at 8 rows, 5.2
    vs 7.0 at 16, 8.3 vs 12.1 at 32) and trailed at 4 (4.6 vs 4.1): bf16 takes it from 5 rows on wherever
    the build has bf16 dot products. In fp32 the kernel stays ahead of oneDNN to 64 rows (87.8 vs 169.2 ms at
    64). On an AVX2-only AMD EPYC oneDNN is further behind (fp32: 65 vs 196 ms at 16 rows, 118 vs 314 at 32,
    323 vs 426 at 64, level at 128; bf16, which oneDNN emulates there: 239 vs 1128 ms at 64), so the avx2
    build serves up to 64 rows too."""
    if variant == "avx2":
        return 64
    if variant != "avx512bf16" or dtype == torch.bfloat16:
        return 4
    return 64


def linear_kernel_rows(device: torch.device) -> dict[torch.dtype, int]:
    """dtype -> the most rows of an input that takes the weight-streaming linear here (absent: never)."""
    return {dt: small_batch_rows(kernel_variant()[0], dt) for dt in linear_kernel_dtypes(device)}


def describe_kernels(device: torch.device, dtype: torch.dtype, head_dim: int = 0) -> str:
    """One start-up line: which kernels serve this model and why (or why not)."""
    if device.type != "cpu":
        return f"Custom CPU kernels: off ({device.type} device); torch's attention and matmuls"
    if envs.VLLM_NEURON_DISABLE_NKI_KERNELS:
        return "Custom CPU kernels: off (VLLM_NEURON_DISABLE_NKI_KERNELS=1); torch's attention and matmuls"
    if not kernels_enabled(device):
        return "Custom CPU kernels: unavailable (the build failed, see above); torch's attention and matmuls"
    variant, why = kernel_variant()
    rows = linear_kernel_rows(device).get(dtype)
    linear = (f"weight-streaming linear up to {rows} rows, oneDNN above" if rows
              else f"no {str(dtype).removeprefix('torch.')} linear kernel in this build: oneDNN matmuls")
    from vllm_neuron.model.layers.packed_weights import _AMX_ROWS, dot_kernel_built, tile_kernel_built

    if rows and dtype == torch.bfloat16 and tile_kernel_built():
        linear = f"weight-streaming linear up to {rows} rows, AMX tile linear to {_AMX_ROWS}, oneDNN above"
    elif rows and dtype == torch.bfloat16 and dot_kernel_built():
        linear = f"weight-streaming linear up to {rows} rows, bf16 dot-product linear on packed weights above"
    attention = "paged attention"
    if dtype == torch.bfloat16 and head_dim and attention_rows_path(head_dim) != _ROWS_PATHS[0]:
        attention += f" (prefill over a bf16 cache: {attention_rows_path(head_dim)})"
    return f"Custom CPU kernels: {variant} build ({why}): {attention}; {linear}"


_ROWS_PATHS = ("fp32 vectors", "bf16 dot products", "AMX tiles")


def attention_rows_path(head_dim: int) -> str:
    """How paged attention's many-row items (prefill, verify) over a bf16 cache with this head dim run here:
    "AMX tiles" (the build targets AMX-BF16 and the OS hands out tile state), "bf16 dot products" (AVX512-BF16
    builds), else "fp32 vectors" (keys widened; also every head dim that is no multiple of 32)."""
    if not _has_op("bf16_rows_path"):
        return _ROWS_PATHS[0]
    return _ROWS_PATHS[torch.ops.vllm_neuron.bf16_rows_path(head_dim)]


def attention_on_tiles(head_dim: int) -> bool:
    """Whether paged attention's many-row items over a bf16 cache with this head dim run on AMX tiles here."""
    return attention_rows_path(head_dim) == "AMX tiles"


def quant_kernels_available(device: torch.device) -> bool:
    """Whether the int8/int4 weight-streaming linears are built here (AVX-512 and AVX2 builds)."""
    return kernels_enabled(device) and _has_op("linear_int8") and _has_op("linear_int4")


def kernels_enabled(device: torch.device) -> bool:
    """Whether the custom kernels serve this device (building them on first call)."""
    if envs.VLLM_NEURON_DISABLE_NKI_KERNELS or device.type != "cpu":
        return False
    return _load()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start: torch.Tensor, positions: torch.Tensor, scale: float, block_size: int,
                    sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Causal attention of every query row over its sequence's cached keys 0..position.

    q [N, H, D]; caches [slots, KV, D] (the rows' own K/V already written); block_tables [S, n];
    query_start [S + 1] (rows of sequence s: query_start[s]..query_start[s + 1]); positions [N].
    sinks [H]: one logit per query head joining the softmax (gpt-oss); window: a row sees only keys
    position - window + 1 .. position (the rest of the table may be null blocks).
    Returns [N, H, D]; rows of no sequence (padding) are 0."""
    return torch.ops.vllm_neuron.paged_attention(q, k_cache, v_cache, block_tables, query_start, positions,
                                                 scale, block_size, sinks, window or 0)


def paged_attention_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start: torch.Tensor, positions: torch.Tensor, scale: float, block_size: int,
                        k_scale: torch.Tensor, v_scale: torch.Tensor, sinks: torch.Tensor | None = None,
                        window: int | None = None) -> torch.Tensor:
    """`paged_attention` over FP8 caches (float8_e4m3fn / float8_e5m2) holding K / k_scale and V / v_scale;
    q and the result in the compute dtype."""
    return torch.ops.vllm_neuron.paged_attention_fp8(q, k_cache, v_cache, block_tables, query_start, positions,
                                                     scale, block_size, k_scale, v_scale, sinks, window or 0)


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (q [N, K] int8 * scale [N])^T -> [M, N] in x's dtype, K a multiple of 16; for small M.
    q in quant_int8's band layout."""
    return torch.ops.vllm_neuron.linear_int8(x, q, scale)


def linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T, W in quant_int4's packed band layout ([N, K / 2] uint8, [N, K / 32, 2] fp32) -> [M, N]."""
    return torch.ops.vllm_neuron.linear_int4(x, packed, scales)


def unpack_int8(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quant_int8's band-layout q -> the row-major [N, K] q in `dtype` (exact)."""
    return torch.ops.vllm_neuron.unpack_int8(q, dtype)


def unpack_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quant_int4's packed band layout -> the row-major [N, K] weight in `dtype` (q * scale + min in fp32)."""
    return torch.ops.vllm_neuron.unpack_int4(packed, scales, dtype)


def linear_small_batch(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N] in x's dtype (bf16 or fp32), K a multiple of 32; for small M (decode)."""
    if x.dtype == torch.bfloat16:
        return torch.ops.vllm_neuron.linear_bf16(x, w)
    return torch.ops.vllm_neuron.linear_f32(x, w)
