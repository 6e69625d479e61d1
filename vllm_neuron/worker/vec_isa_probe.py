"""Inductor's vector-ISA probe, skipped where this process's kernel build has answered it.

Before inductor generates or loads CPU code in a process, it asks which vector instruction sets it may use:
for each one the CPU lists (AVX-512, AVX2) it compiles a test program on ATen's vector headers with that
set's flags and loads it in a child process. That cost every engine process ~1 s with a warm inductor cache
(Engine ready 5.5-6.4 -> 5.0-5.4 s on the bundled model, all 8 graphs loaded) and 5-7 s with a cold one
(2-core AMD EPYC Zen 4 VM, 2026-12-07). Our kernel build answers the same question first: it compiled
ATen's headers with this compiler for the CPU's own class. An `avx512bf16` build is `-march=native` on a CPU
with AVX-512 (every AVX-512 and AVX2 flag inductor passes), an `avx2` build is x86-64-v3 (AVX2, FMA, F16C:
inductor's AVX2 flags) and covers a CPU without AVX-512 only. Where that holds, inductor's
`cpp.vec_isa_ok` is set. Its narrower probes (AVX512-BF16, VNNI, AMX) still run, so the ISA it picks, the
flags it compiles with and its cache keys are what they were.
"""
from __future__ import annotations

import platform

from vllm_neuron.logger import init_logger

logger = init_logger(__name__)


def build_covers_inductor_isas(variant: str, cpu_flags: set[str]) -> bool:
    """Whether a kernel build of `variant` that compiled on this CPU answers inductor's probe for every
    vector ISA inductor would try here (pure)."""
    if variant == "avx512bf16":
        return True  # -march=native on an AVX-512 CPU
    if variant == "avx2":
        return "avx512f" not in cpu_flags  # x86-64-v3 says nothing about AVX-512 flags
    return False


def skip_answered_probe(variant: str, cpu_flags: set[str]) -> bool:
    """Sets inductor's `cpp.vec_isa_ok` where `variant`'s build, loaded in this process, answers its probe;
    True where it did. A value the user set (TORCHINDUCTOR_VEC_ISA_OK) is left as it is."""
    import torch._inductor.config as inductor_config

    if platform.machine() not in ("x86_64", "AMD64") or inductor_config.cpp.vec_isa_ok is not None:
        return False
    if not build_covers_inductor_isas(variant, cpu_flags):
        return False
    inductor_config.cpp.vec_isa_ok = True
    logger.debug("Inductor's vector-ISA probe skipped: the %s kernel build compiled here", variant)
    return True
