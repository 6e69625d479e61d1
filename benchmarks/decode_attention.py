"""Decode attention alone, from memory, against the bandwidth its KV bytes need (`python benchmarks/decode_attention.py`).

The bundled model's attention shapes (30 layers, 9 query heads over 3 KV heads of 64, bf16 cache, blocks of
32 in a shuffled block table): one decode step's 30 calls of the paged attention kernel, each layer's K/V its
own tensors so that nothing stays in cache between layers. Prints the median step time and the bytes read
per second, for each (batch, context) case, with the KV pool in 4 KiB pages and, with `--huge-pages`, in
2 MiB ones (VLLM_NEURON_KV_HUGE_PAGES), alternating runs in one process. Beside it the machine's read
bandwidth (an fp32 sum of 1 GiB), the bound the step would have at that bandwidth.

    python benchmarks/decode_attention.py [--cases 1x8159,16x2048,16x512] [--rounds 12] [--huge-pages]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers.report import measure_read_bandwidth  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 32


def make_case(batch: int, context: int, huge: bool, seed: int = 0, block: int = BLOCK):
    """(caches per layer, block tables, query_start, positions, q) for `batch` sequences of `context` tokens in
    blocks of `block` tokens."""
    from vllm_neuron import huge_pages

    blocks = (context + block - 1) // block
    slots = blocks * block * batch
    place = huge_pages.copy if huge else (lambda t: t)
    g = torch.Generator().manual_seed(seed)
    caches = [tuple(place(torch.randn(slots, KV_HEADS, HEAD_DIM, generator=g).bfloat16()) for _ in range(2))
              for _ in range(LAYERS)]
    tables = torch.randperm(blocks * batch, generator=g).view(batch, blocks).contiguous()
    return (caches, tables, torch.arange(batch + 1), torch.full((batch,), context - 1),
            torch.randn(batch, HEADS, HEAD_DIM, generator=g).bfloat16())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="1x8159,16x2048,16x512", help="batch x context, comma-separated")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--huge-pages", action="store_true", help="also the KV pool in 2 MiB pages")
    p.add_argument("--block-size", type=int, default=BLOCK, help="tokens per KV block (the engine's --block-size)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    a = p.parse_args()
    from vllm_neuron.model.layers.kernels import build, cpu_caps
    from vllm_neuron.model.layers.kernels.ops import paged_attention

    variant, why = cpu_caps.kernel_variant()
    if not build.load(variant):
        sys.exit("the custom CPU kernels did not build")
    if a.threads:
        torch.set_num_threads(a.threads)
    bandwidth = measure_read_bandwidth(threads=torch.get_num_threads())
    print(f"kernels: {variant} ({why}); {torch.get_num_threads()} threads; read bandwidth {bandwidth / 1e9:.1f} GB/s")
    print("| batch x context | pages | step (ms) | KV read (MB) | GB/s | bound at the read bandwidth (ms) | step / bound |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case in a.cases.split(","):
        batch, context = (int(x) for x in case.split("x"))
        kinds = {"4 KiB": make_case(batch, context, False, block=a.block_size)}
        if a.huge_pages:
            kinds["2 MiB"] = make_case(batch, context, True, block=a.block_size)
        times: dict[str, list[float]] = {k: [] for k in kinds}

        def step(c):
            caches, tables, starts, pos, q = c
            for k, v in caches:
                paged_attention(q, k, v, tables, starts, pos, HEAD_DIM ** -0.5, a.block_size)

        for c in kinds.values():
            step(c)  # first touch and warm-up
        for _ in range(a.rounds):
            for name, c in kinds.items():
                t0 = time.perf_counter()
                step(c)
                times[name].append(time.perf_counter() - t0)
        kv_bytes = LAYERS * 2 * batch * context * KV_HEADS * HEAD_DIM * 2
        for name, ts in times.items():
            med = statistics.median(ts)
            bound = kv_bytes / bandwidth
            print(f"| {batch} x {context} | {name} | {med * 1e3:.2f} | {kv_bytes / 1e6:.0f} | "
                  f"{kv_bytes / med / 1e9:.1f} | {bound * 1e3:.2f} | {med / bound:.2f}x |")
        del kinds


if __name__ == "__main__":
    main()
