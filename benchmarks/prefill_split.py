"""Prompts split at bucket sizes (core/prefill_batching.first_segment) against one padded step, same engine, same
run: the scheduler's setting is switched between requests, alternating, so both sides see the same machine.

Part 1, time to first token of one prompt alone (prefix caching off, `max_tokens=1`), by prompt length.
Part 2, the offline workload of `offline_throughput.py` (64 prompts of 32-256 tokens, 32-128 output tokens, 16
at a time): wall time and the prefill steps' time, and whether the greedy outputs are identical.

    python benchmarks/prefill_split.py [--rounds 4] [--lengths 129,160,192,257,320,400,600]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from offline_throughput import workload  # noqa: E402
from step_timing import time_steps  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4, help="alternating rounds (the first is dropped as warm-up)")
    p.add_argument("--lengths", default="129,160,192,257,320,400,600")
    p.add_argument("--offline-rounds", type=int, default=2)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    from vllm_neuron import LLM, SamplingParams

    llm = LLM(None, max_model_len=2048, max_num_seqs=16, enable_prefix_caching=False)
    sched = llm.llm_engine.core.scheduler
    modes = {"on": sched.config, "off": dataclasses.replace(sched.config, split_prompts_at_buckets=False)}
    if not modes["on"].split_prompts_at_buckets:
        raise SystemExit("this engine does not split prompts (not CPU, or no attention kernel)")
    rng = random.Random(1)
    one = SamplingParams(max_tokens=1)
    ttft: dict[tuple[int, str], list[float]] = {}
    for r in range(args.rounds):
        print(f"  TTFT round {r + 1} of {args.rounds} ...", flush=True)
        for n in lengths:
            for mode, cfg in modes.items():
                sched.config = cfg
                ids = [rng.randrange(100, 40000) for _ in range(n)]
                t0 = time.perf_counter()
                llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
                ttft.setdefault((n, mode), []).append(time.perf_counter() - t0)
    print("\n| prompt tokens | one padded step (ms) | split at buckets (ms) | split / padded |\n| --- | --- | --- | --- |")
    for n in lengths:
        a, b = (statistics.median(ttft[(n, m)][1:] or ttft[(n, m)]) * 1e3 for m in ("off", "on"))
        print(f"| {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")

    reqs = workload(llm.get_tokenizer(), 64, 0, (32, 256), (32, 128))
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    rows, outputs = [], {}
    for r in range(args.offline_rounds):
        for mode, cfg in modes.items():
            print(f"  offline workload, round {r + 1}, split {mode} ...", flush=True)
            sched.config = cfg
            times = time_steps(llm)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            del llm.llm_engine.core.runner.execute  # time_steps' wrapper: the class's method again
            prefill = {k: v for k, v in times.items() if k.startswith("prefill")}
            steps = ", ".join(f"{len(v)} {k[len('prefill_'):]}" for k, v in sorted(prefill.items()))
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append((mode, wall, sum(map(sum, prefill.values())), tokens / wall, steps))
            outputs[mode] = [o.outputs[0].token_ids for o in outs]
    print("\n| split | wall (s) | prefill steps (s) | output tok/s | prefill steps |\n| --- | --- | --- | --- | --- |")
    for mode, wall, pre, tps, steps in rows:
        print(f"| {mode} | {wall:.2f} | {pre:.2f} | {tps:.1f} | {steps} |")
    print(f"\ngreedy outputs identical with and without splitting: {outputs['on'] == outputs['off']}")


if __name__ == "__main__":
    main()
