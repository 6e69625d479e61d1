"""Issue 45's encoder-cache measurement: hit rate of the block encoder cache on a workload that repeats images,
with the cache at its floor (the blocks one step's encoder budget needs) and at its default size.

    python benchmarks/encoder_cache_hits.py [--requests 64] [--pool 8] [--zipf 1.1] [--batch 4]

Requests carry one 112x112 image each, drawn from a pool of `--pool` images with Zipf-like popularity (seeded),
sent `--batch` at a time to one offline engine (a tiny random-weight Qwen3-VL: the hit rate depends on the
workload and the cache, not on the weights). Prints hits, misses, evictions, encoder calls and the hit rate.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests.model_factory import tiny_llm  # noqa: E402
from tests.vlm_factory import IMAGE, make_tiny_qwen3_vl, random_image  # noqa: E402

ENCODER = {"encoder_attention_block_size": 128, "num_encoder_input_buckets": [128, 256]}
BUCKETS = {"num_batched_tokens_buckets": [32, 64], "num_seqs_buckets": [1, 4]}


def workload(requests: int, pool: int, zipf: float, seed: int) -> list[int]:
    """Which pool image each request carries: rank r drawn with weight 1 / (r + 1) ** zipf (pure)."""
    weights = 1.0 / np.arange(1, pool + 1) ** zipf
    return np.random.default_rng(seed).choice(pool, size=requests, p=weights / weights.sum()).tolist()


def run(model_dir: str, picks: list[int], images: list, batch: int, num_blocks: int | None) -> dict:
    from vllm_neuron import SamplingParams

    enc = {**ENCODER, **({"encoder_cache_num_blocks": num_blocks} if num_blocks else {})}
    llm = tiny_llm(model_dir, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=128,
                   enforce_eager=True, additional_config={"neuron_config": BUCKETS, "encoder_neuron_config": enc})
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    kind = llm.llm_engine.core.runner.kinds[0]
    t0 = time.perf_counter()
    for i in range(0, len(picks), batch):
        prompts = [{"prompt": f"Request {i + j}: {IMAGE} what is it?", "multi_modal_data": {"image": [images[p]]}}
                   for j, p in enumerate(picks[i:i + batch])]
        llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    cache = kind.encoder_cache
    out = {"blocks": cache.num_blocks, "hits": cache.hits, "misses": cache.misses, "evictions": cache.evictions,
           "encoder_calls": kind.num_encoder_runs, "wall_s": wall}
    llm.llm_engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--pool", type=int, default=8, help="distinct images")
    p.add_argument("--zipf", type=float, default=1.1, help="popularity skew of the pool")
    p.add_argument("--batch", type=int, default=4, help="requests per generate call")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    model_dir = make_tiny_qwen3_vl(tempfile.mkdtemp(prefix="vl_cache_"))
    images = [random_image(112, 112, 100 + i) for i in range(a.pool)]
    picks = workload(a.requests, a.pool, a.zipf, a.seed)
    print(f"{a.requests} requests, {len(set(picks))} distinct of a pool of {a.pool} images (zipf {a.zipf}), "
          f"{a.batch} per call", flush=True)
    print(f"{'cache':<28}{'blocks':>8}{'hits':>6}{'misses':>8}{'evict':>7}{'encoder calls':>15}{'hit rate':>10}"
          f"{'wall s':>8}")
    # Floor: 1 requested is raised to the minimum (2 blocks of 32 tokens: one 64-token step's media).
    for label, blocks in (("floor (encoder budget)", 1), ("default (256 MiB)", None)):
        r = run(model_dir, picks, images, a.batch, blocks)
        rate = r["hits"] / max(1, r["hits"] + r["misses"])
        print(f"{label:<28}{r['blocks']:>8}{r['hits']:>6}{r['misses']:>8}{r['evictions']:>7}{r['encoder_calls']:>15}"
              f"{rate:>10.2f}{r['wall_s']:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
