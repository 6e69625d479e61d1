"""Prefill attention alone: one segment of a long prompt's prefill (`--rows` query rows at the end of a
`--context`-token sequence) through the paged attention kernel, against the machine's bf16 matmul peak
(`python benchmarks/prefill_attention.py`). The bundled model's attention shapes (9 query heads over 3 KV heads
of 64, bf16 cache, blocks of 32 in a shuffled block table). Counts the causal products only (each query row's
keys up to its own position, QK^T and PV, two flops a product) and prints the median time of one layer's call,
its GFLOP/s and the fraction of the peak.

    python benchmarks/prefill_attention.py [--cases 512x8192,512x4096,512x1024] [--rounds 20]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_bounds import measure_matmul_peak  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 32


def make_case(rows: int, context: int, seed: int = 0):
    """(k cache, v cache, block table, query_start, positions, q): the last `rows` tokens of one sequence."""
    g = torch.Generator().manual_seed(seed)
    blocks = (context + BLOCK - 1) // BLOCK
    k, v = (torch.randn(blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=g).bfloat16() for _ in range(2))
    table = torch.randperm(blocks, generator=g).view(1, blocks).contiguous()
    positions = torch.arange(context - rows, context)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g).bfloat16()
    return k, v, table, torch.tensor([0, rows]), positions, q


def causal_flops(rows: int, context: int) -> float:
    keys = sum(p + 1 for p in range(context - rows, context))
    return keys * HEADS * HEAD_DIM * 4.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="512x8192,512x4096,512x1024", help="rows x context, comma-separated")
    p.add_argument("--rounds", type=int, default=20)
    a = p.parse_args()
    from vllm_neuron.model.layers.kernels import build, cpu_caps
    from vllm_neuron.model.layers.kernels.ops import paged_attention

    variant, why = cpu_caps.kernel_variant()
    if not build.load(variant):
        sys.exit("the custom CPU kernels did not build")
    peak = measure_matmul_peak(torch.get_num_threads())
    print(f"kernels: {variant} ({why}); {torch.get_num_threads()} threads; bf16 matmul peak {peak / 1e9:.0f} GFLOP/s")
    print("| rows x context | one layer (ms) | GFLOP/s | of the matmul peak |")
    print("| --- | --- | --- | --- |")
    for case in a.cases.split(","):
        rows, context = (int(x) for x in case.split("x"))
        k, v, table, starts, pos, q = make_case(rows, context)
        paged_attention(q, k, v, table, starts, pos, HEAD_DIM ** -0.5, BLOCK)  # warm-up
        times = []
        for _ in range(a.rounds):
            t0 = time.perf_counter()
            paged_attention(q, k, v, table, starts, pos, HEAD_DIM ** -0.5, BLOCK)
            times.append(time.perf_counter() - t0)
        med = statistics.median(times)
        flops = causal_flops(rows, context)
        print(f"| {rows} x {context} | {med * 1e3:.2f} | {flops / med / 1e9:.0f} | {flops / med / peak:.2f} |")


if __name__ == "__main__":
    main()
