"""Weight quantization and FP8 KV on the bundled model, in one run: batch-1 TPOT, P1-style throughput,
weight memory and greedy answers to knowledge questions for the default dtype's weights (fp32 on CPUs
without bf16 units, bf16 on those with AVX512-BF16 or AMX) and int8 / int4 weights, each with its ratio
to the default; then the concurrent full-length sequences the engine's own KV sizing gives the default
KV dtype and FP8 KV.

batch-1 TPOT: the median wall time of the runner's decode steps (benchmarks/step_timing.py) of one
request of --tpot-tokens output tokens, every round together. Per-step medians, not (time of N tokens -
time of 1) / (N - 1): a load spike on a shared machine then moves one step, not the figure.
P1-style throughput: --p1-requests requests of --p1-input random prompt tokens and --p1-output output
tokens, 16 at a time (offline LLM.generate, max_num_seqs 16, EOS ignored): output tokens / wall
seconds (best round), with the median 16-row decode step beside it.

Each scheme runs in a process of its own (no shared caches, threads or allocator); the parent asks them
for one measurement at a time in turn, so that a shared machine's load hits each alike while the others
wait idle. Compare the ratios of one run; absolute figures move with the machine's load.

    python benchmarks/quantization.py [--schemes fp32,int8,int4] [--rounds 3] [--quick] [--eager]
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_timing import median_ms, steps_of, time_steps  # noqa: E402

QUESTIONS = [  # (question, a word the answer must contain)
    ("What is the capital of France? Answer in one short sentence.", "Paris"),
    ("What is the capital of Japan? Answer in one short sentence.", "Tokyo"),
    ("What is the capital of Italy? Answer in one short sentence.", "Rome"),
    ("Which planet is known as the Red Planet? Answer in one short sentence.", "Mars"),
    ("What is the largest ocean on Earth? Answer in one short sentence.", "Pacific"),
    ("Who wrote Romeo and Juliet? Answer in one short sentence.", "Shakespeare"),
    ("What gas do plants absorb from the air? Answer in one short sentence.", "carbon dioxide"),
    ("How many days are there in a week? Answer in one short sentence.", "seven"),
]
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
QUANTS = ("int8", "int4")
CONCURRENCY = 16  # P1's
BLOCK = 32


def machine_class() -> tuple[str, str]:
    """(default dtype's scheme name, a line saying which CPU class this is and what it runs)."""
    import torch

    from vllm_neuron.config.device import cpu_has_fast_bf16, resolve_dtype
    from vllm_neuron.model.layers.kernels.cpu_caps import kernel_variant

    default = "bf16" if resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16 else "fp32"
    units = "AVX512-BF16 or AMX (bf16 units)" if cpu_has_fast_bf16() else "no bf16 units (AVX2 class)"
    variant, why = kernel_variant()
    return default, (f"CPU class: {units}; kernel build {variant} ({why}); default dtype {default}; "
                     f"{len(os.sched_getaffinity(0))} cores")


def _weight_mib(model) -> float:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total / 2**20


def _make(scheme: str, args):
    from vllm_neuron import LLM

    nc = {"quantization": scheme} if scheme in QUANTS else {}
    max_len = max(args.p1_input + args.p1_output, args.tpot_tokens + 64)
    max_len = -(-max_len // BLOCK) * BLOCK
    return LLM(model=args.model, dtype=DTYPES.get(scheme, "auto"), max_model_len=max_len, max_num_seqs=CONCURRENCY,
               num_gpu_blocks_override=CONCURRENCY * (max_len // BLOCK) + 1, enable_prefix_caching=False,
               enforce_eager=args.eager, kv_cache_dtype=args.kv_cache_dtype, additional_config={"neuron_config": nc})


class _Child:
    """One engine in a child process; measurements on request, their step times by bucket."""

    def __init__(self, scheme: str, args) -> None:
        self.llm = _make(scheme, args)
        self.times = time_steps(self.llm)
        self.vocab = self.llm.llm_engine.core.runner.ckpt.hf_config.vocab_size

    def prompts(self, n: int, length: int, seed: int) -> list[dict]:
        rng = random.Random(seed)
        return [{"prompt_token_ids": [rng.randrange(5, self.vocab - 10) for _ in range(length)]} for _ in range(n)]

    def generate(self, prompts: list[dict], max_tokens: int) -> tuple[float, int]:
        from vllm_neuron import SamplingParams

        self.times.clear()
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                 use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    def tpot(self, tokens: int, seed: int) -> dict:
        self.generate(self.prompts(1, 32, seed), tokens)
        return {"steps": steps_of(self.times, "decode", 1)}

    def p1(self, n: int, input_len: int, output_len: int, seed: int) -> dict:
        seconds, tokens = self.generate(self.prompts(n, input_len, seed), output_len)
        return {"seconds": seconds, "tokens": tokens, "steps": steps_of(self.times, "decode", CONCURRENCY)}

    def answers(self) -> list[str]:
        from vllm_neuron import SamplingParams

        outs = self.llm.chat([[{"role": "user", "content": q}] for q, _ in QUESTIONS],
                             SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
        return [o.outputs[0].text for o in outs]


def _serve_one(scheme: str, args) -> None:
    """Child process: builds one engine, reports its memory and answers, then serves 'tpot' / 'p1' lines."""
    child = _Child(scheme, args)
    answers = child.answers()
    child.tpot(4, seed=0)  # first-touch warm-up of the batch-1 bucket
    print(json.dumps({"mib": _weight_mib(child.llm.llm_engine.core.runner.model), "answers": answers}), flush=True)
    for line in sys.stdin:
        cmd, *nums = line.split()
        vals = [int(x) for x in nums]
        print(json.dumps(child.tpot(*vals) if cmd == "tpot" else child.p1(*vals)), flush=True)


def _spawn(scheme: str, args) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", scheme, "--kv-cache-dtype", args.kv_cache_dtype,
           "--tpot-tokens", str(args.tpot_tokens), "--p1-input", str(args.p1_input),
           "--p1-output", str(args.p1_output)]
    if args.model:
        cmd += ["--model", args.model]
    if args.eager:
        cmd.append("--eager")
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _ask(proc: subprocess.Popen, line: str | None = None) -> dict:
    if line is not None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
    for out in proc.stdout:  # the engine's own prints may come first
        if out.startswith("{"):
            return json.loads(out)
    raise RuntimeError(f"the benchmark process exited ({proc.wait()})")


def _capacity(default: str, model: str | None) -> None:
    """Concurrent max_model_len sequences the default KV budget holds (the engine's own sizing, default
    options) with the default KV dtype and with FP8."""
    from vllm_neuron import LLM

    print("\nKV capacity: the engine's default budget and options, eager")
    print("| kv_cache_dtype | KV blocks | tokens per block | max_model_len | blocks per full-length sequence | "
          "concurrent full-length sequences | vs auto |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    base = None
    for kv in ("auto", "fp8"):
        llm = LLM(model=model, enforce_eager=True, kv_cache_dtype=kv)
        core = llm.llm_engine.core
        n, per = core.num_blocks - 1, core.runner.request_blocks()  # block 0 is reserved
        seqs = n / per
        base = base or seqs
        print(f"| {kv} ({default if kv == 'auto' else 'float8_e4m3fn'}) | {n} | {core.runner.block_size} | "
              f"{core.config.max_model_len} | {per} | {seqs:.1f} | {seqs / base:.2f}x |", flush=True)
        del llm, core
        gc.collect()


def _report(schemes: list[str], default: str, first: dict, tpot: dict, p1: dict, args) -> None:
    n_steps = {s: len(v) for s, v in tpot.items()}
    tp = {s: median_ms(v) for s, v in tpot.items()}
    best = {s: max(t / sec for sec, t in p1[s]["runs"]) for s in schemes}
    b16 = {s: median_ms(p1[s]["steps"]) for s in schemes}
    print(f"\nbundled model{' ' + args.model if args.model else ''}, kv_cache_dtype={args.kv_cache_dtype}, "
          f"{'eager' if args.eager else 'compiled'}, {args.rounds} round(s), one process per scheme")
    print(f"batch-1 TPOT: median decode_b1 step of one {args.tpot_tokens}-token request per round; "
          f"P1-style: {args.p1_requests} x {args.p1_input} random prompt tokens -> {args.p1_output}, "
          f"{CONCURRENCY} concurrent, best round")
    print(f"| weights | batch-1 TPOT (ms) | TPOT speed-up vs {default} | P1 out tok/s | P1 vs {default} | "
          "decode_b16 median (ms) | weight memory (MiB) | knowledge answers |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for s in schemes:
        ok = sum(word.lower() in a.lower() for (_, word), a in zip(QUESTIONS, first[s]["answers"]))
        up = f"{tp[default] / tp[s]:.2f}x" if default in tp else "-"
        thr = f"{best[s] / best[default]:.2f}x" if default in best else "-"
        print(f"| {s} | {tp[s]:.1f} ({n_steps[s]} steps) | {up} | {best[s]:.1f} | {thr} | {b16[s]:.1f} | "
              f"{first[s]['mib']:.0f} | {ok}/{len(QUESTIONS)} |")
    for s in schemes:
        for (q, _), a in zip(QUESTIONS, first[s]["answers"]):
            print(f"{s}: {q.split('?')[0]}? -> {a.strip()!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=None, help="comma list of fp32, bf16, int8, int4 "
                   "(default: the default dtype's name, int8, int4)")
    p.add_argument("--model", default=None, help="model path (default: the bundled model)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--tpot-tokens", type=int, default=64, help="output tokens of the batch-1 request")
    p.add_argument("--p1-requests", type=int, default=64)
    p.add_argument("--p1-input", type=int, default=256)
    p.add_argument("--p1-output", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="measurements of each kind per scheme, in turn")
    p.add_argument("--eager", action="store_true", help="run the buckets uncompiled")
    p.add_argument("--quick", action="store_true", help="smoke run: eager, 1 round, 16 x 256 -> 32 P1 requests, "
                   "32-token TPOT request")
    p.add_argument("--capacity-only", action="store_true", help="only the KV capacity, default vs FP8 KV")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.eager, args.rounds, args.p1_requests, args.p1_output, args.tpot_tokens = True, 1, CONCURRENCY, 32, 32
    if args.child:
        _serve_one(args.child, args)
        return
    default, line = machine_class()
    print(line, flush=True)
    schemes = args.schemes.split(",") if args.schemes else [default, *QUANTS]
    bad = [s for s in schemes if s not in (*DTYPES, *QUANTS)]
    if bad or args.rounds < 1:
        raise ValueError(f"--schemes: unknown {bad}; valid: {', '.join((*DTYPES, *QUANTS))}" if bad
                         else f"--rounds must be >= 1, got {args.rounds}")
    if not args.capacity_only:
        _run_schemes(schemes, default, args)
    _capacity(default, args.model)


def _run_schemes(schemes: list[str], default: str, args) -> None:
    procs, first = {}, {}
    tpot: dict[str, list[float]] = {s: [] for s in schemes}
    p1: dict[str, dict] = {s: {"runs": [], "steps": []} for s in schemes}
    try:
        for s in schemes:  # one at a time: building and compiling would disturb the others' measurements
            print(f"[{s}] starting ...", flush=True)
            procs[s] = _spawn(s, args)
            first[s] = _ask(procs[s])
        for r in range(args.rounds):
            for s in schemes:
                tpot[s] += _ask(procs[s], f"tpot {args.tpot_tokens} {r + 1}")["steps"]
            for s in schemes:
                got = _ask(procs[s], f"p1 {args.p1_requests} {args.p1_input} {args.p1_output} {100 + r}")
                p1[s]["runs"].append((got["seconds"], got["tokens"]))
                p1[s]["steps"] += got["steps"]
                print(f"[{s}] round {r + 1}: batch-1 TPOT so far {median_ms(tpot[s]):.1f} ms, P1 "
                      f"{got['tokens'] / got['seconds']:.1f} tok/s", flush=True)
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    if not all(math.isfinite(median_ms(tpot[s])) for s in schemes):
        raise RuntimeError("no batch-1 decode step was recorded")
    _report(schemes, default, first, tpot, p1, args)


if __name__ == "__main__":
    main()
