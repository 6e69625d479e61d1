"""One decode step's linears with the weights in torch's allocator (4 KiB pages) against the same weights side
by side in one huge-page arena (huge_pages.Arena, what the engine loads them into), in one process.

The bundled model's 120 layer linears (30 layers x qkv, o, gate_up, down) are made twice, one set left where
torch put them and one moved into an arena; each round times one pass over every linear of each set in turn
through the weight-streaming kernel (so both see the machine's drift alike), at each row count. Prints the
medians over the rounds, the weight bytes per second, and arena / 4 KiB.

    python benchmarks/weight_pages.py [--rows 1,4] [--rounds 25] [--dtype bfloat16|float32]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_neuron import huge_pages
from vllm_neuron.model.layers.kernels.cpu_caps import kernels_enabled

# SmolLM2-135M: fused qkv, o, fused gate_up, down, as the model holds them
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def layer_weights(seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, k, generator=g).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4", help="input rows (the weight-streaming kernel serves 1-4)")
    p.add_argument("--rounds", type=int, default=25)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the weights' dtype (float32: the AVX2 class's default)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    op_name = "linear_bf16" if dtype == torch.bfloat16 else "linear_f32"
    if not kernels_enabled(torch.device("cpu")) or not hasattr(torch.ops.vllm_neuron, op_name):
        raise SystemExit("no weight-streaming kernel on this CPU (it needs AVX2 + FMA or AVX-512)")
    if not huge_pages.available():
        raise SystemExit("huge pages are not available here (THP off, or VLLM_NEURON_HUGE_PAGES=0)")
    plain = layer_weights(0, dtype)
    moved = layer_weights(1, dtype)
    arena = huge_pages.Arena(sum(huge_pages.Arena.footprint(w) for w in moved))
    moved = [arena.place(w) for w in moved]
    nbytes = sum(w.numel() * w.element_size() for w in plain)
    op = getattr(torch.ops.vllm_neuron, op_name).default
    print(f"{len(plain)} linears, {nbytes / 1e6:.0f} MB of {args.dtype} weights a pass; "
          f"{torch.get_num_threads()} threads")
    print("| rows | 4 KiB pages (ms) | arena (ms) | GB/s, 4 KiB / arena | arena / 4 KiB |")
    print("| --- | --- | --- | --- | --- |")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).to(dtype) for _, k in SHAPES}

        def one_pass(ws: list[torch.Tensor]) -> float:
            t0 = time.perf_counter()
            for w in ws:
                op(xs[w.shape[1]], w)
            return time.perf_counter() - t0

        one_pass(plain), one_pass(moved)
        times: dict[str, list[float]] = {"4k": [], "arena": []}
        for _ in range(args.rounds):
            times["4k"].append(one_pass(plain))
            times["arena"].append(one_pass(moved))
        a, b = (statistics.median(times[k]) for k in ("4k", "arena"))
        print(f"| {rows} | {a * 1e3:.2f} | {b * 1e3:.2f} | {nbytes / a / 1e9:.1f} / {nbytes / b / 1e9:.1f} "
              f"| {b / a:.2f}x |")


if __name__ == "__main__":
    main()
