"""`--device auto|cpu|cuda` and `--dtype` resolution; how data-parallel replicas on one host share its memory."""
from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess

import torch

from vllm_neuron.config.cpu_class import cpu_class, cpu_flags

DEVICE_CHOICES = ("auto", "cpu", "cuda")
DTYPE_CHOICES = ("auto", "float32", "float", "bfloat16", "float16", "half")
_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def resolve_device(device: str) -> torch.device:
    """`auto` picks CUDA when present, unless VLLM_NEURON_CPU_MODE=1 forces the CPU."""
    from vllm_neuron import envs

    if device not in DEVICE_CHOICES:
        raise ValueError(f"device={device!r} is not valid; choose one of {list(DEVICE_CHOICES)}")
    if envs.VLLM_NEURON_CPU_MODE:
        if device == "cuda":
            raise ValueError("device='cuda' conflicts with VLLM_NEURON_CPU_MODE=1 (which forces the CPU); "
                             "unset one of them")
        return torch.device("cpu")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but torch sees no CUDA device; use --device cpu or auto")
    return torch.device(device)


# /proc/cpuinfo flags that change what a compiler may emit for this CPU (-march=native, inductor's
# vector ISA); a cache built with one set must never run on a CPU that lacks one of them.
_ISA_FLAG_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "popcnt", "lzcnt", "movbe", "adx",
                      "aes", "pclmul", "sha", "gfni", "vaes", "vpclmul", "asimd", "sve", "sme", "fp", "neon")


@functools.lru_cache(maxsize=1)
def cpu_isa() -> str:
    """The host's architecture and instruction-set extensions, e.g. 'x86_64:avx,avx2,avx512f,...'
    (part of the compile-cache and kernel-cache keys)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    flags.update(value.split())
    except OSError:
        pass
    isa = sorted(f for f in flags if f.startswith(_ISA_FLAG_PREFIXES))
    return f"{platform.machine()}:{','.join(isa)}"


@functools.lru_cache(maxsize=None)
def compiler_id(cxx: str) -> str:
    """`cxx --version`'s first line (the C++ compiler a kernel or graph is built with), or 'missing'."""
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx}: missing"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return f"{path}: unknown"
    return f"{path}: {out.splitlines()[0] if out else 'unknown'}"


def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmuls run 3-6x faster than fp32 there (measured on this project's CI CPUs).
    VLLM_NEURON_CPU_ISA forcing a lower class (avx2, generic) takes that class's dtype too."""
    from vllm_neuron import envs

    if envs.VLLM_NEURON_CPU_ISA in ("avx2", "generic"):
        return False
    return _cpuinfo_has_fast_bf16()


def _cpuinfo_has_fast_bf16() -> bool:
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def dtype_reason(dtype: str | torch.dtype, device: torch.device) -> str:
    """Why resolve_dtype chose what it chose, for the start-up log."""
    if isinstance(dtype, torch.dtype) or dtype != "auto":
        return "set by --dtype"
    if device.type == "cuda":
        return "auto: bfloat16 on CUDA"
    return _cpu_auto_dtype()[1]


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
    return _cpu_auto_dtype()[0]


def _cpu_auto_dtype() -> tuple[torch.dtype, str]:
    """`--dtype auto` on this CPU, and why. bfloat16 wherever a kernel build multiplies it at fp32's speed or
    better: AVX512-BF16 / AMX in hardware, and the AVX2 class, whose kernels widen bf16 weights to fp32 in
    registers and whose larger matmuls run in fp32 on weights widened per call (half the bytes a decode step
    streams). float32 where bf16 would be emulated: the generic build, or the kernels switched off."""
    from vllm_neuron import envs

    if cpu_has_fast_bf16():
        return torch.bfloat16, "auto: this CPU has AVX512-BF16 or AMX, where bf16 matmuls run 3-6x faster than fp32"
    variant = cpu_class()
    forced = (f"VLLM_NEURON_CPU_ISA={envs.VLLM_NEURON_CPU_ISA} runs this CPU as the {variant} class"
              if envs.VLLM_NEURON_CPU_ISA in ("avx2", "generic") and _cpuinfo_has_fast_bf16()
              else f"this CPU has neither AVX512-BF16 nor AMX ({variant} class)")
    if variant != "avx2":
        return torch.float32, f"auto: {forced}, where bf16 matmuls are emulated, so float32"
    if envs.VLLM_NEURON_DISABLE_NKI_KERNELS:
        return torch.float32, (f"auto: {forced}, and VLLM_NEURON_DISABLE_NKI_KERNELS=1 turns off the kernels that "
                               "widen bf16 to fp32, so float32")
    return torch.bfloat16, (f"auto: {forced}: bf16 weights widened to fp32 in the kernels, half the bytes of "
                            "float32: batch-1 decode steps about twice as fast, prefill up to a sixth slower "
                            "(--dtype float32 for the other trade)")


BF16_WEIGHTS = "bf16"  # neuron_config.quantization's "no quantization, bfloat16 weights"


def resolve_model_dtype(dtype: str | torch.dtype, device: torch.device,
                        quantization: str | None) -> tuple[torch.dtype, str]:
    """The model's dtype and why (the start-up log's reason). neuron_config.quantization='bf16' (the seeds'
    Qwen3-VL example) asks for unquantized bfloat16 weights: it picks bfloat16 and refuses another --dtype."""
    if quantization != BF16_WEIGHTS:
        return resolve_dtype(dtype, device), dtype_reason(dtype, device)
    if dtype != "auto" and resolve_dtype(dtype, device) != torch.bfloat16:
        raise ValueError(f"neuron_config.quantization='bf16' asks for unquantized bfloat16 weights, but dtype={dtype!r}; "
                         "remove one of them (or give dtype='bfloat16')")
    return torch.bfloat16, "neuron_config.quantization='bf16': unquantized bfloat16 weights"


def replicas_sharing_memory(on_cuda: bool, replicas: int, cuda_count: int) -> int:
    """How many of a host's `replicas` share one replica's memory: all of them share the host's RAM on CPU;
    on CUDA they take the GPUs round-robin, so as many as share the most loaded GPU (pure)."""
    replicas = max(replicas, 1)
    if not on_cuda:
        return replicas
    if cuda_count < 1:
        raise ValueError("placing data parallel replicas on CUDA needs at least one visible GPU")
    return -(-replicas // cuda_count)


def async_scheduling_default(device: torch.device) -> tuple[bool, str]:
    """(on, why) for async scheduling when the user did not choose.

    It overlaps host work (scheduling, output processing) with the forward pass: a win when the forward
    runs on an accelerator or leaves CPU cores idle. When torch's threads already use every core, the
    "device" is the host itself and the overlapped host work steals a core from the forward
    (bench: P2 TPOT 24.4 ms with it, 17.5 ms without, on 2 cores)."""
    if device.type != "cpu":
        return True, "on by default"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if torch.get_num_threads() >= cores:
        return False, (f"off by default on CPU: torch's {torch.get_num_threads()} threads use all {cores} cores, so "
                       "host work overlapped with the forward would slow it; --async-scheduling turns it on")
    return True, f"on by default ({cores - torch.get_num_threads()} CPU cores left for host work)"


WEIGHT_QUANTIZATIONS = ("int8", "int4")  # neuron_config.quantization values built so far


def check_weight_quantization(scheme: str, dtype: torch.dtype, device: torch.device) -> None:
    """Where the bad option enters: weight-only int8/int4 run on the CPU device in a float dtype."""
    if scheme not in WEIGHT_QUANTIZATIONS:
        raise ValueError(f"neuron_config.quantization={scheme!r} is not supported yet by vllm-neuron; valid values: "
                         f"{', '.join(WEIGHT_QUANTIZATIONS)} (weight-only, CPU)")
    if device.type != "cpu":
        raise ValueError(f"neuron_config.quantization={scheme!r} (weight-only {scheme}) runs on the CPU device only; "
                         f"the engine runs on {device.type}. Remove quantization or use --device cpu")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"neuron_config.quantization={scheme!r} needs dtype float32, bfloat16 or float16, got {dtype}")
