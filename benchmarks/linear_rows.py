"""The weight-streaming linear kernel against torch's F.linear (oneDNN) at 1-64 rows, bf16 and fp32, and the bf16
path above the kernel's rows on AVX2 CPUs (F.linear in fp32 on the weights widened per call, `widen_bf16`), on
the bundled model's linear shapes, one run. Milliseconds for one decode step's worth (the four layer shapes x 30
layers; the four weights stay in the caches between calls, so this times the kernels' arithmetic, not memory).

Each row count times every variant in turn, --rounds times, in a new random order each round, and prints medians
and the kernel / F.linear ratio per dtype. The kernel build is this CPU's class, or the one forced by
VLLM_NEURON_CPU_ISA (with ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2, torch's side is held to AVX2 too).

    python benchmarks/linear_rows.py [--rows 1,2,3,4,5,8,16,64,128,512] [--rounds 21]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vllm_neuron.model.layers.kernels import cpu_caps

# SmolLM2-135M (the bundled model): fused QKV, O, fused gate/up, down; 30 layers.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def variants(m: int, generator: torch.Generator) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """name -> a call computing one layer's four products at `m` rows (random inputs and weights of SHAPES)."""
    ops = torch.ops.vllm_neuron
    w32 = [torch.randn(n, k, generator=generator) for n, k in SHAPES]
    wb = [w.bfloat16() for w in w32]
    x32 = [torch.randn(m, k, generator=generator) for _, k in SHAPES]
    xb = [x.bfloat16() for x in x32]
    return {
        "kernel fp32": lambda: [ops.linear_f32(x, w) for x, w in zip(x32, w32)],
        "F.linear fp32": lambda: [F.linear(x, w) for x, w in zip(x32, w32)],
        "kernel bf16": lambda: [ops.linear_bf16(x, w) for x, w in zip(xb, wb)],
        "F.linear bf16": lambda: [F.linear(x, w) for x, w in zip(xb, wb)],
        "widened bf16": lambda: [F.linear(x.float(), w.float()).bfloat16() for x, w in zip(xb, wb)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,5,8,16,64,128,512")
    ap.add_argument("--rounds", type=int, default=21)
    args = ap.parse_args()
    if not cpu_caps.kernels_enabled(torch.device("cpu")):
        raise SystemExit("no custom kernels on this machine (VLLM_NEURON_DISABLE_NKI_KERNELS, or no build)")
    variant, why = cpu_caps.kernel_variant()
    g = torch.Generator().manual_seed(0)
    print(f"kernel build: {variant} ({why}); torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| rows | kernel fp32 | F.linear fp32 | kernel / F.linear | kernel bf16 | F.linear bf16 | kernel / F.linear "
          "| widened bf16 | widened / F.linear bf16 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in map(int, args.rows.split(",")):
        calls = variants(m, g)
        times: dict[str, list[float]] = {name: [] for name in calls}
        for fn in calls.values():
            fn()  # warm: first touches, oneDNN's primitive caches
        for _ in range(args.rounds):
            for name in random.sample(list(calls), len(calls)):
                t0 = time.perf_counter()
                calls[name]()
                times[name].append((time.perf_counter() - t0) * LAYERS * 1e3)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(f"| {m} | {med['kernel fp32']:.1f} | {med['F.linear fp32']:.1f} | "
              f"{med['kernel fp32'] / med['F.linear fp32']:.2f} | {med['kernel bf16']:.1f} | {med['F.linear bf16']:.1f} | "
              f"{med['kernel bf16'] / med['F.linear bf16']:.2f} | {med['widened bf16']:.1f} | "
              f"{med['widened bf16'] / med['F.linear bf16']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
