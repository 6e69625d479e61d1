"""What this CPU and its kernel build offer: the build variant (CPU class), which dtypes and how many rows
the weight-streaming linear serves, whether the quantized and tile-order linears run, how paged attention's
many-row items run, and the start-up line that says so. Nothing here switches a layer: the runner turns
these answers into a `KernelConfig` (model/layers/kernel_config.py) handed to the model it builds."""
from __future__ import annotations

import functools

import torch

from vllm_neuron import envs
from vllm_neuron.config.cpu_class import choose_variant, cpu_flags
from vllm_neuron.logger import init_logger
from vllm_neuron.model.layers.kernels import build
from vllm_neuron.model.layers.kernels.ops import has_op, pack_tiles

logger = init_logger(__name__)

# Up to this many rows the AMX tile kernel's copy serves (measured in packed_weights.py; its four C tiles stop
# at 64); the VDPBF16PS tile-order kernel serves every row count.
AMX_ROWS = 32
UNBOUNDED = 1 << 62


@functools.lru_cache(maxsize=1)
def kernel_variant() -> tuple[str, str]:
    """(variant, why) of this process' build."""
    return choose_variant(cpu_flags(), envs.VLLM_NEURON_CPU_ISA)


def kernels_enabled(device: torch.device) -> bool:
    """Whether the custom kernels serve this device (building them on first call)."""
    if envs.VLLM_NEURON_DISABLE_NKI_KERNELS or device.type != "cpu":
        return False
    return build.load(kernel_variant()[0])  # a VLLM_NEURON_CPU_ISA this CPU cannot run is refused, not fallen back from


def linear_kernel_dtypes(device: torch.device) -> frozenset[torch.dtype]:
    """The dtypes the weight-streaming linear is built for here (AVX512-BF16: bf16 and fp32; AVX2: the
    same via conversion; generic: none)."""
    if not kernels_enabled(device):
        return frozenset()
    ops = {torch.bfloat16: "linear_bf16", torch.float32: "linear_f32"}
    return frozenset(dt for dt, op in ops.items() if has_op(op))


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


def quant_kernels_available(device: torch.device) -> bool:
    """Whether the int8/int4 weight-streaming linears are built here (AVX-512 and AVX2 builds)."""
    return kernels_enabled(device) and has_op("linear_int8") and has_op("linear_int4")


def quant_kernel_rows(device: torch.device, dtype: torch.dtype) -> int:
    """The most input rows the int8 / int4 kernels take for `dtype` inputs here (0: not built). bf16 rows on
    AVX512-BF16 builds dequantize each band once into L1 and run VDPBF16PS, which beats dequantizing the whole
    weight for oneDNN up to 64 rows (Zen 5 EPYC, `benchmarks/step_bounds.py --quantization int4 / int8`, one
    run each: prefill_s32 27.5 -> 17.1 ms and 34.2 -> 18.3, prefill_s64 36.1 -> 28.6 and 51.0 -> 31.0); the
    other paths re-widen the weights per block of four rows, so they stop at 16."""
    if not quant_kernels_available(device):
        return 0
    return 64 if dtype == torch.bfloat16 and has_op("linear_dot_tiles") else 16


_ROWS_PATHS = ("fp32 vectors", "bf16 dot products", "AMX tiles")


def attention_rows_path(head_dim: int) -> str:
    """How paged attention's many-row items (prefill, verify) over a bf16 cache with this head dim run here:
    "AMX tiles" (the build targets AMX-BF16 and the OS hands out tile state), "bf16 dot products" (AVX512-BF16
    builds), else "fp32 vectors" (keys widened; also every head dim that is no multiple of 32)."""
    if not has_op("bf16_rows_path"):
        return _ROWS_PATHS[0]
    return _ROWS_PATHS[torch.ops.vllm_neuron.bf16_rows_path(head_dim)]


def attention_on_tiles(head_dim: int) -> bool:
    """Whether paged attention's many-row items over a bf16 cache with this head dim run on AMX tiles here."""
    return attention_rows_path(head_dim) == "AMX tiles"


def packing_pays(device: torch.device, dtype: torch.dtype, flags: set[str]) -> bool:
    """Whether packed weight copies pay here (pure but for torch's build): bf16 on a CPU with bf16 dot products
    in hardware (AVX512-BF16, AMX). On AVX2-only CPUs oneDNN emulates bf16 and the kernel serves more rows."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and bool({"amx_bf16", "avx512_bf16"} & flags)
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def widen_pays(device: torch.device, dtype: torch.dtype, variant: str) -> bool:
    """Whether bf16 linears above the weight-streaming kernel's rows run in fp32 on weights widened per call
    (pure): the avx2 class has no bf16 matmul (neither AVX512-BF16 nor AMX), and oneDNN emulates bf16 there at
    a fifth to a quarter of its fp32 speed (the bundled model's linears under the forced avx2 build, 30 layers:
    2,920 ms bf16 against 590 fp32 at 512 rows, 601 widened). The generic build has no kernel for the rows
    below, where widening the whole weight every step would double what a decode step streams."""
    return device.type == "cpu" and dtype == torch.bfloat16 and variant == "avx2"


@functools.lru_cache(maxsize=1)
def tile_kernel_built() -> bool:
    """Whether this machine's kernel build has the AMX tile linear (an avx512bf16 build on an AMX CPU) and it
    runs: a kernel older than Linux 5.16 hands out no tile state, and the probe's error hands its rows on."""
    if not (kernels_enabled(torch.device("cpu")) and has_op("linear_amx")):
        return False
    try:
        w = torch.ones(16, 32, dtype=torch.bfloat16)
        y = torch.ops.vllm_neuron.linear_amx(torch.ones(1, 32, dtype=torch.bfloat16), pack_tiles(w), None, 16)
    except RuntimeError as e:
        logger.warning("AMX tile linear unavailable (%s); the bf16 dot-product kernel or oneDNN serves its rows", e)
        return False
    return bool((y == 32).all())


@functools.lru_cache(maxsize=1)
def dot_kernel_built() -> bool:
    """Whether this machine's kernel build has the VDPBF16PS tile-order linear (any avx512bf16 build)."""
    return kernels_enabled(torch.device("cpu")) and has_op("linear_dot_tiles")


def tile_kernel() -> tuple[object, int] | None:
    """The kernel that takes tile-order copies here and the most rows it serves: AMX tiles up to `AMX_ROWS`
    where they run, else VDPBF16PS dot products at every row count; None without either."""
    if tile_kernel_built():
        return torch.ops.vllm_neuron.linear_amx, AMX_ROWS
    if dot_kernel_built():
        return torch.ops.vllm_neuron.linear_dot_tiles, UNBOUNDED
    return None


def describe_copies() -> str:
    """Which packed copies serve which rows here, for the start-up log."""
    if tile_kernel_built():
        return f"AMX tile kernel up to {AMX_ROWS} rows, oneDNN reordered above"
    if dot_kernel_built():
        return "bf16 dot-product kernel on tile-order copies"
    return "oneDNN reordered"


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
    if rows and dtype == torch.bfloat16 and tile_kernel_built():
        linear = f"weight-streaming linear up to {rows} rows, AMX tile linear to {AMX_ROWS}, oneDNN above"
    elif rows and dtype == torch.bfloat16 and dot_kernel_built():
        linear = f"weight-streaming linear up to {rows} rows, bf16 dot-product linear on packed weights above"
    attention = "paged attention"
    if dtype == torch.bfloat16 and head_dim and attention_rows_path(head_dim) != _ROWS_PATHS[0]:
        attention += f" (prefill over a bf16 cache: {attention_rows_path(head_dim)})"
    return f"Custom CPU kernels: {variant} build ({why}): {attention}; {linear}"
