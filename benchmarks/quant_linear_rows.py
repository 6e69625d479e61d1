"""int8 / int4 decode linears at 1-16 rows: our kernel vs dequantize + matmul vs F.linear on the
dequantized weight (what the unquantized model runs), on the bundled model's linear shapes, one run.

For each shape and row count, every variant is timed in turn, --rounds times, in a new random order each round
(a shared machine's load, and what one variant leaves in the caches or the core for the next, hit each alike: in a
fixed order the variant after the unquantized F.linear ran up to 1.8x slower);
--from-memory reads 256 MB before every call, so each reads its weights from memory as a decode step of a
model larger than the caches does; the table holds medians in microseconds, the ratio of the kernel to the cheapest
alternative that keeps the weights quantized (dequantize + matmul, the path above the kernel rows, here the torch one), and the
ratio to the unquantized F.linear. The last row sums every linear of one decoder layer x layers + lm_head.
Where the build has the AVX2 integer-dot path (`VLLM_NEURON_CPU_ISA=avx2`, or an AVX2-only CPU), the kernels'
earlier path, weights widened to fp32 ("widened"), and the integer-dot path ("int_dot") run beside them, each
called as the raw op (no Python wrapper, unlike "kernel"), and the table adds int_dot / widened: the A/B.

    python benchmarks/quant_linear_rows.py [--rows 1,4,8,16] [--rounds 30] [--threads N] [--from-memory]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F

from vllm_neuron.model.layers.kernels.ops import has_op

# SmolLM2-135M (the bundled model): hidden 576, 9 q heads / 3 KV heads of 64, intermediate 1536, 30 layers,
# vocab 49152; fused q/k/v and gate/up as the model holds them.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
LAYERS = 30


def _time_us(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def variants(n: int, k: int, rows: int, dtype: torch.dtype) -> dict:
    """name -> a zero-argument call computing x @ W^T one way, on one random [n, k] weight."""
    from vllm_neuron.model.layers import quant_int4, quant_int8

    w = torch.randn(n, k) * 0.05
    x = torch.randn(rows, k).to(dtype)
    q8, s8 = quant_int8.quantize(w)
    q4, s4 = quant_int4.quantize(w)
    w_deq = quant_int8.dequantize(q8, s8, dtype)
    out = {
        "int8 kernel": lambda: quant_int8.linear(x, q8, s8, None, kernel_rows=rows),
        "int8 dequant+matmul": lambda: quant_int8.linear(x, q8, s8, None, kernel_rows=0),
        "int4 kernel": lambda: quant_int4.linear(x, q4, s4, None, kernel_rows=rows),
        "int4 dequant+matmul": lambda: quant_int4.linear(x, q4, s4, None, kernel_rows=0),
        "F.linear unquantized": lambda: F.linear(x, w_deq),
    }
    if has_op("linear_quant_path"):
        path = torch.ops.vllm_neuron.linear_quant_path
        for p in ("int_dot", "widened"):
            out[f"int8 {p}"] = lambda p=p: path(x, q8, s8, p)
            out[f"int4 {p}"] = lambda p=p: path(x, q4, s4, p)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,8,16")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--from-memory", action="store_true", help="evict the caches before every call")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from vllm_neuron.model.layers.kernels.cpu_caps import kernel_variant, quant_kernels_available

    if not quant_kernels_available(torch.device("cpu")):
        raise SystemExit("the int8/int4 kernels are not built here (no AVX2, or VLLM_NEURON_DISABLE_NKI_KERNELS=1)")
    dtype = getattr(torch, args.dtype)
    flush = torch.ones(64 << 20) if args.from_memory else None
    print(f"kernel build {kernel_variant()[0]}, {args.threads} threads, activations {args.dtype}, median of "
          f"{args.rounds} in turn (microseconds)" + (", weights read from memory" if flush is not None else ""))
    names = None
    for rows in [int(r) for r in args.rows.split(",")]:
        calls = {shape: variants(n, k, rows, dtype) for shape, (n, k) in SHAPES.items()}
        names = names or list(next(iter(calls.values())))
        for fns in calls.values():
            for fn in fns.values():
                fn()  # first call: oneDNN's kernel choice, page faults
        samples = {shape: {name: [] for name in names} for shape in SHAPES}
        for r in range(args.rounds):
            for shape, fns in calls.items():
                order = list(fns.items())
                random.Random(r).shuffle(order)
                for name, fn in order:
                    if flush is not None:
                        flush.sum()
                    samples[shape][name].append(_time_us(fn))
        med = {shape: {name: statistics.median(v) for name, v in samples[shape].items()} for shape in SHAPES}
        step = {name: sum(med[s][name] * (1 if s == "lm_head" else LAYERS) for s in SHAPES) for name in names}
        print(f"\nrows {rows}")
        widened = "int8 widened" in names
        print("| shape [N, K] | " + " | ".join(names) + " | int8 kernel / dequant | int4 kernel / dequant | "
              "int8 kernel / unquantized | int4 kernel / unquantized |"
              + (" int8 int_dot / widened | int4 int_dot / widened |" if widened else ""))
        print("| --- " * (len(names) + 5 + 2 * widened) + "|")
        for label, m in [*((f"{s} {list(SHAPES[s])}", med[s]) for s in SHAPES), ("one decode step's linears", step)]:
            ratios = [m["int8 kernel"] / m["int8 dequant+matmul"], m["int4 kernel"] / m["int4 dequant+matmul"],
                      m["int8 kernel"] / m["F.linear unquantized"], m["int4 kernel"] / m["F.linear unquantized"]]
            if widened:
                ratios += [m["int8 int_dot"] / m["int8 widened"], m["int4 int_dot"] / m["int4 widened"]]
            print(f"| {label} | " + " | ".join(f"{m[n]:.0f}" for n in names) + " | "
                  + " | ".join(f"{r:.2f}" for r in ratios) + " |", flush=True)


if __name__ == "__main__":
    main()
