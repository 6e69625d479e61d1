"""Weight quantization and FP8 KV on the bundled model, in one run: batch-1 decode TPOT, weight memory and
greedy answers to knowledge questions for bf16 / int8 / int4 weights; KV capacity with bf16 and FP8 KV
(the default budget, the model's full context).

TPOT is timed as (time of a request with --max-tokens output tokens - time with 1) / (--max-tokens - 1),
best of --repeat. Each scheme runs in a process of its own (no shared caches, threads or allocator), and
the parent asks them for one measurement at a time in turn, so that a shared machine's load hits each
alike while the others wait idle. Compiled graphs (a decode bucket of 1 and one prefill bucket) are
built once per scheme first.

    python benchmarks/quantization.py [--schemes bf16,int8,int4] [--max-tokens 64] [--repeat 3] [--capacity-only]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

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


def _weight_mib(model) -> float:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total / 2**20


def _make(scheme: str, kv_cache_dtype: str, compiled: bool):
    from vllm_neuron import LLM

    nc = {"num_seqs_buckets": [1], "num_batched_tokens_buckets": [128]}
    if scheme != "bf16":
        nc["quantization"] = scheme
    return LLM(max_model_len=1024, max_num_seqs=1, num_gpu_blocks_override=64, enforce_eager=not compiled,
               kv_cache_dtype=kv_cache_dtype, additional_config={"neuron_config": nc})


def _tpot(llm, max_tokens: int) -> float:
    from vllm_neuron import SamplingParams

    prompt = [{"prompt_token_ids": [1] + [100 + i for i in range(32)]}]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0

    return (run(max_tokens) - run(1)) / (max_tokens - 1)


def _answers(llm) -> list[str]:
    from vllm_neuron import SamplingParams

    outs = llm.chat([[{"role": "user", "content": q}] for q, _ in QUESTIONS],
                    SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _capacity() -> None:
    """KV blocks and concurrent full-length (model's 8192-token context) sequences the same budget holds."""
    from vllm_neuron import LLM

    print("\n| kv_cache_dtype | KV blocks (32 tokens) | concurrent 8192-token sequences |")
    print("| --- | --- | --- |")
    for kv in ("auto", "fp8"):
        llm = LLM(enforce_eager=True, kv_cache_dtype=kv)
        n = llm.llm_engine.core.num_blocks - 1  # block 0 is reserved
        print(f"| {kv} | {n} | {n / (8192 // 32):.1f} |")
        del llm
        gc.collect()


def _serve_one(scheme: str, kv_cache_dtype: str, compiled: bool) -> None:
    """Child process: builds one engine, reports its memory and answers, then one TPOT per 'tpot N' line."""
    llm = _make(scheme, kv_cache_dtype, compiled)
    model = llm.llm_engine.core.runner.model
    answers = _answers(llm)
    _tpot(llm, 4)  # warm
    print(json.dumps({"mib": _weight_mib(model), "answers": answers}), flush=True)
    for line in sys.stdin:
        print(json.dumps({"tpot": _tpot(llm, int(line.split()[1]))}), flush=True)


def _spawn(scheme: str, args) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", scheme, "--kv-cache-dtype", args.kv_cache_dtype]
    if args.eager:
        cmd.append("--eager")
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _reply(proc: subprocess.Popen) -> dict:
    for line in proc.stdout:  # the engine's own prints may come first
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"the benchmark process exited ({proc.wait()})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default="bf16,int8,int4")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="run the buckets uncompiled")
    p.add_argument("--capacity-only", action="store_true", help="only the bf16 vs FP8 KV capacity")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _serve_one(args.child, args.kv_cache_dtype, not args.eager)
        return
    if args.capacity_only:
        _capacity()
        return
    schemes = args.schemes.split(",")
    procs, mib, answers = {}, {}, {}
    try:
        for s in schemes:  # one at a time: building and compiling would disturb the others' measurements
            procs[s] = _spawn(s, args)
            first = _reply(procs[s])
            mib[s], answers[s] = first["mib"], first["answers"]
        runs: dict[str, list[float]] = {s: [] for s in schemes}
        for _ in range(args.repeat):
            for s in schemes:
                procs[s].stdin.write(f"tpot {args.max_tokens}\n")
                procs[s].stdin.flush()
                runs[s].append(_reply(procs[s])["tpot"])
    finally:
        for proc in procs.values():
            proc.stdin.close()
            proc.wait()
    best = {s: min(v) for s, v in runs.items()}
    print(f"\nbatch-1 decode, bundled model, kv_cache_dtype={args.kv_cache_dtype}, best of {args.repeat}, "
          "one process per scheme")
    print("| weights | TPOT (ms) | vs bf16 | weight memory (MiB) | knowledge answers |")
    print("| --- | --- | --- | --- | --- |")
    base = best.get("bf16")
    for s in schemes:
        ok = sum(word.lower() in a.lower() for (_, word), a in zip(QUESTIONS, answers[s]))
        ratio = f"{base / best[s]:.2f}x" if base else "-"
        print(f"| {s} | {best[s] * 1e3:.1f} | {ratio} | {mib[s]:.0f} | {ok}/{len(QUESTIONS)} |")
    for s in schemes:
        for (q, _), a in zip(QUESTIONS, answers[s]):
            print(f"{s}: {q.split('?')[0]}? -> {a.strip()!r}")
    _capacity()


if __name__ == "__main__":
    main()
