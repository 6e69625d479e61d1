"""Pipeline parallelism on this machine's CPU: decode step times and TTFT of PP=2 (two stages of 15 layers, one
process each; decode in one piece and in two micro-batches) against TP=2 and TP=1 (all cores, and one thread), in
the same run.

    python benchmarks/pp_step_times.py [--batch 4 --prompt-len 128 --decode-tokens 16 --reps 2 --compiled]

The model is tp_step_cost.py's: SmolLM2-135M's shapes (30 layers, hidden 576, vocabulary 49152) with 8 heads
and 2 KV heads so that two TP ranks can split it, random weights. TTFT: one prompt of --prompt-len tokens, one
token out (prefix caching off). Decode: --batch prompts of 16 tokens, (time for 1 + D tokens - time for 1) / D,
the step time at that batch. Ranks split the cores (TP=1 takes them all). Run it on an idle machine for absolute
numbers; on a shared one compare the rows of one run only.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from tp_step_cost import scratch_model  # the SmolLM2-shaped model (run as a script from benchmarks/)


def _ms(llm, prompts: list[list[int]], max_tokens: int, reps: int) -> float:
    from vllm_neuron import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    from vllm_neuron import LLM

    cores = len(os.sched_getaffinity(0))
    model = scratch_model("pp_step_times_")
    gen = torch.Generator().manual_seed(1)
    long_prompt = [torch.randint(100, 40000, (a.prompt_len,), generator=gen).tolist()]
    batch = [torch.randint(100, 40000, (16,), generator=gen).tolist() for _ in range(a.batch)]
    rows = []
    # TP=1 on every core and on one (a loaded machine punishes a multi-threaded step: it waits for its slowest
    # thread); the ranks of TP=2 and PP=2 split the cores.
    for name, tp, pp, micro, threads in (("TP=1", 1, 1, None, cores), ("TP=1, 1 thread", 1, 1, None, 1),
                                         ("TP=2", 2, 1, None, cores), ("PP=2", 1, 2, 1, cores),
                                         ("PP=2, 2 micro-batches", 1, 2, 2, cores)):
        torch.set_num_threads(threads)
        os.environ["VLLM_NEURON_PP_MICRO_BATCHES"] = str(micro or 1)
        llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, enforce_eager=not a.compiled,
                  dtype=a.dtype, device="cpu", max_model_len=1024, max_num_seqs=a.batch,
                  max_num_batched_tokens=max(a.prompt_len, 16 * a.batch), enable_prefix_caching=False,
                  additional_config={"neuron_config": {"num_batched_tokens_buckets": [max(a.prompt_len, 16 * a.batch)],
                                                       "num_seqs_buckets": [a.batch]}})
        try:
            _ms(llm, long_prompt, 2, 1)  # warm
            ttft = _ms(llm, long_prompt, 1, a.reps)
            one = _ms(llm, batch, 1, a.reps)
            step = (_ms(llm, batch, 1 + a.decode_tokens, a.reps) - one) / a.decode_tokens
        finally:
            llm.llm_engine.shutdown()
        rows.append((name, ttft, step))
    del os.environ["VLLM_NEURON_PP_MICRO_BATCHES"]
    mode = "compiled" if a.compiled else "eager"
    print(f"SmolLM2-shaped model (30 layers), {mode}, {cores} cores; TTFT: a {a.prompt_len}-token prompt; "
          f"decode: batch {a.batch}")
    print(f"{'':<24} {'TTFT ms':>9} {'decode step ms':>15}")
    for name, ttft, step in rows:
        print(f"{name:<24} {ttft:>9.1f} {step:>15.1f}")


if __name__ == "__main__":
    main()
