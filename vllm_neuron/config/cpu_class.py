"""This CPU's class (avx512bf16, avx2, generic): the kernel build it takes and, through it, the dtype `auto` picks.
Read from /proc/cpuinfo, or forced lower with VLLM_NEURON_CPU_ISA (pure functions but for the two readers)."""
from __future__ import annotations

CLASSES = ("avx512bf16", "avx2", "generic")  # best first; kernels/build.py has one build per class


def cpu_flags() -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def detect_variant(flags: set[str]) -> str:
    """The best class this CPU runs (pure)."""
    if "avx512_bf16" in flags and "avx512bw" in flags:
        return "avx512bf16"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "generic"


def choose_variant(flags: set[str], forced: str | None) -> tuple[str, str]:
    """(class, why): `forced` (VLLM_NEURON_CPU_ISA) when this CPU runs it, else the best it runs (pure)."""
    best = detect_variant(flags)
    if forced is None:
        return best, "detected from /proc/cpuinfo"
    if CLASSES.index(forced) < CLASSES.index(best):
        raise ValueError(f"VLLM_NEURON_CPU_ISA={forced} needs instructions this CPU lacks (best here: {best}); "
                         f"valid values: {', '.join(CLASSES[CLASSES.index(best):])}")
    return forced, "forced by VLLM_NEURON_CPU_ISA"


def cpu_class() -> str:
    """This process' class: VLLM_NEURON_CPU_ISA's when set (refused when this CPU cannot run it), else detected."""
    from vllm_neuron import envs

    return choose_variant(cpu_flags(), envs.VLLM_NEURON_CPU_ISA)[0]
