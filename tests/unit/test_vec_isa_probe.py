"""Inductor's vector-ISA probe is skipped only where our kernel build answered it (worker/vec_isa_probe.py)."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch._inductor.config as inductor_config

from vllm_neuron.config import cpu_class
from vllm_neuron.model.layers.kernels import cpu_caps
from vllm_neuron.worker import vec_isa_probe
from vllm_neuron.worker.vec_isa_probe import build_covers_inductor_isas, skip_answered_probe

AVX512_BF16 = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16"}
AVX512_ONLY = {"avx2", "fma", "f16c", "avx512f", "avx512bw"}
AVX2_ONLY = {"avx2", "fma", "f16c"}


@pytest.mark.parametrize("variant,flags,covered", [
    ("avx512bf16", AVX512_BF16, True),
    ("avx2", AVX2_ONLY, True),
    ("avx2", AVX512_ONLY, False),  # an AVX-512 CPU without BF16 builds x86-64-v3: AVX-512 flags unproven
    ("avx2", AVX512_BF16, False),  # forced AVX2 on an AVX-512 CPU
    ("generic", AVX2_ONLY, False),
])
def test_which_builds_answer_the_probe(variant: str, flags: set[str], covered: bool) -> None:
    assert build_covers_inductor_isas(variant, flags) is covered


@pytest.fixture
def unset_vec_isa_ok(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(vec_isa_probe.platform, "machine", lambda: "x86_64")
    with inductor_config.patch({"cpp.vec_isa_ok": None}):
        yield


def test_a_covering_build_sets_vec_isa_ok(unset_vec_isa_ok) -> None:
    assert skip_answered_probe("avx512bf16", AVX512_BF16)
    assert inductor_config.cpp.vec_isa_ok is True


def test_an_uncovering_build_leaves_the_probe(unset_vec_isa_ok) -> None:
    assert not skip_answered_probe("avx2", AVX512_ONLY)
    assert inductor_config.cpp.vec_isa_ok is None


def test_the_users_setting_is_kept(unset_vec_isa_ok) -> None:
    with inductor_config.patch({"cpp.vec_isa_ok": False}):  # TORCHINDUCTOR_VEC_ISA_OK=0
        assert not skip_answered_probe("avx512bf16", AVX512_BF16)
        assert inductor_config.cpp.vec_isa_ok is False


def test_not_on_other_architectures(unset_vec_isa_ok, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vec_isa_probe.platform, "machine", lambda: "aarch64")
    # A covering variant and flags: only the architecture keeps the probe (inductor runs none there).
    assert not skip_answered_probe("avx512bf16", AVX512_BF16)
    assert inductor_config.cpp.vec_isa_ok is None


_PICK = ("from torch._inductor import cpu_vec_isa as c; p = c.pick_vec_isa(); "
         "print([str(i) for i in c.valid_vec_isa_list()], str(p), p.build_arch_flags())")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="inductor probes vector ISAs on x86 only")
def test_inductor_picks_the_same_isa_and_flags_without_the_probe() -> None:
    """Skipping the probe must not change the code inductor generates or its cache keys on this machine."""
    if not build_covers_inductor_isas(cpu_class.detect_variant(cpu_caps.cpu_flags()), cpu_caps.cpu_flags()):
        pytest.skip("this CPU's kernel build does not answer the probe: the engine keeps it")
    picks = []
    for ok in (None, "1"):  # unset: the probe runs; 1: skipped (0 would turn vectorization off)
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
        if ok is not None:
            env["TORCHINDUCTOR_VEC_ISA_OK"] = ok
        out = subprocess.run([sys.executable, "-c", _PICK], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        picks.append(out.stdout.strip())
    assert picks[0] == picks[1]
    assert "avx2" in picks[0]  # the probe passed something: the comparison is not of two empty lists


@pytest.mark.engine
def test_an_engine_with_our_kernels_skips_the_probe(tiny_llama_dir: str) -> None:
    """The runner sets it once the kernels are built for this CPU's class; a user's setting wins."""
    flags = cpu_caps.cpu_flags()
    variant = cpu_class.detect_variant(flags)
    if platform.machine() not in ("x86_64", "AMD64") or not build_covers_inductor_isas(variant, flags):
        pytest.skip("this CPU's kernel build does not answer inductor's probe")
    code = ("import torch._inductor.config as c; from vllm_neuron import LLM; "
            f"LLM({tiny_llama_dir!r}, enforce_eager=True, max_model_len=128); print('vec_isa_ok', c.cpp.vec_isa_ok)")
    seen = {}
    for user in (None, "0"):
        env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_VEC_ISA_OK"}
        if user is not None:
            env["TORCHINDUCTOR_VEC_ISA_OK"] = user
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        seen[user] = out.stdout.strip().splitlines()[-1]
    assert seen == {None: "vec_isa_ok True", "0": "vec_isa_ok False"}
