"""What an MoE step costs against a dense step of the same active size (the MLP part, which is all
that differs), on this machine's CPU.

    python benchmarks/moe_step_cost.py [--experts 64 --top-k 8 --hidden 1024 --moe-intermediate 384]

The dense reference is a SwiGLU MLP with intermediate = top_k x moe_intermediate (the FLOPs and weight
bytes one token's experts need). Decode batches take the gathered-experts path (tokens x top-k <= E),
prefill batches the dense-over-experts path (model/layers/moe.py). Prints ms per step per layer and the
ratio; run it on an idle machine for absolute numbers.
"""
from __future__ import annotations

import argparse
import time

import torch

from vllm_neuron.model.layers.moe import StackedExperts, softmax_topk
from vllm_neuron.model.llama.model import LlamaMLP


def _time(fn, x, reps: int) -> float:
    with torch.inference_mode():
        fn(x)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn(x)
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-intermediate", type=int, default=384)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 128])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    experts = StackedExperts(a.experts, a.hidden, a.moe_intermediate).to(dtype)
    gate = torch.nn.Linear(a.hidden, a.experts, bias=False).to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=a.hidden ** -0.5)
    dense = LlamaMLP(a.hidden, a.top_k * a.moe_intermediate).to(dtype)

    def moe(x):
        w, ids = softmax_topk(gate(x), a.top_k, True)
        return experts(x, w, ids)

    print(f"E={a.experts} top-k={a.top_k} hidden={a.hidden} moe_intermediate={a.moe_intermediate} {a.dtype}; "
          f"dense reference intermediate={a.top_k * a.moe_intermediate}")
    print(f"{'tokens':>6} {'path':>8} {'MoE ms':>8} {'dense ms':>9} {'ratio':>6}")
    for n in a.tokens:
        x = torch.randn(n, a.hidden, dtype=dtype)
        path = "gather" if n * a.top_k <= a.experts else "dense"
        t_moe, t_dense = _time(moe, x, a.reps), _time(dense, x, a.reps)
        print(f"{n:>6} {path:>8} {t_moe:>8.2f} {t_dense:>9.2f} {t_moe / t_dense:>6.2f}")


if __name__ == "__main__":
    main()
