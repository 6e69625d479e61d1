"""Same-run A/B of two checkouts of this repository: median step time per bucket graph on the bundled model.

Each round runs one child process per checkout, in turn (A then B, then B then A the next round, ...), so that a
machine whose speed drifts slows both alike; every child serves the same offline workload (prefills of 32..512
tokens, decode batches of 1, 4 and 16) and reports every step's wall time by bucket graph. A first, untimed round
per checkout fills its compile cache (each checkout's code has its own cache key). Prints the medians over all
timed rounds and B / A, with the range of the rounds' own B / A and how far A's round medians spread among
themselves: processes of one checkout differ by a few percent on a VM (an A/A run of the same checkout on a 2-core
Zen 4 VM, 2026-12-07, gave B / A 0.97-1.09), so a B / A inside A's own spread is not a difference.

    python benchmarks/ab_steps.py --a /path/to/old-checkout --b . --rounds 3 \
        [--llm-kwargs '{"additional_config": {"neuron_config": {"quantization": "int4"}}}']
    python benchmarks/ab_steps.py --a /path/to/old-checkout --b . --sampled   # decode rows draw, not argmax
    python benchmarks/ab_steps.py --a . --b . \
        --b-llm-kwargs '{"additional_config": {"neuron_config": {"decode_cpp_wrapper": true}}}'   # one option's A/B
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])  # this script's folder: step_timing.py times both checkouts' runners alike
from step_timing import time_steps
from vllm_neuron import LLM, SamplingParams

llm = LLM(max_model_len=2048, **json.loads(sys.argv[2]))  # the bundled model, default dtype and buckets
times = time_steps(llm)
def prompt(n, seed):
    return {"prompt_token_ids": [1 + (seed * 7919 + i * 104729) % 49000 for i in range(n)]}
greedy = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
# --sampled: the decode batches draw (temperature 0.8, top-p 0.95, seeded): the in-graph sampler's random path.
sampled = lambda n: [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=n, ignore_eos=True)
                     for s in range(16)]
decode_params = (lambda n, b: sampled(n)[:b]) if sys.argv[3] == "1" else (lambda n, b: greedy(n))
for n in (32, 64, 128, 256, 512):  # one prefill bucket each (one output token)
    llm.generate([prompt(n, s) for s in range(3)], greedy(1), use_tqdm=False)
for batch in (1, 4, 16):  # decode buckets: 48 steps each
    llm.generate([prompt(24, 100 + s) for s in range(batch)], decode_params(48, batch), use_tqdm=False)
print("AB_RESULT " + json.dumps(times))
"""


def run_child(checkout: str, cache_root: str, llm_kwargs: str, sampled: bool = False) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout), VLLM_CACHE_ROOT=cache_root,
               VLLM_NEURON_LOG_LEVEL="WARNING")
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", _CHILD, here, llm_kwargs, "1" if sampled else "0"], env=env, capture_output=True, text=True, timeout=3600,
                          cwd=tempfile.gettempdir())
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("AB_RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{checkout}: the child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(line.removeprefix("AB_RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="checkout A (the reference)")
    ap.add_argument("--b", required=True, help="checkout B")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (each runs both checkouts, the order alternating; default 3)")
    ap.add_argument("--cache-root", default=os.path.join(tempfile.gettempdir(), "vllm_neuron_ab_cache"),
                    help="VLLM_CACHE_ROOT of the children (kernels, compile caches; kept between runs)")
    ap.add_argument("--llm-kwargs", default="{}", help="JSON of extra LLM(...) arguments for both children")
    ap.add_argument("--b-llm-kwargs", default=None,
                    help="JSON of B's LLM(...) arguments instead of --llm-kwargs (A/B of an option on one checkout)")
    ap.add_argument("--sampled", action="store_true",
                    help="decode batches sample (temperature 0.8, top-p 0.95, seeded) instead of greedy")
    args = ap.parse_args()
    for flag, value in (("--llm-kwargs", args.llm_kwargs), ("--b-llm-kwargs", args.b_llm_kwargs)):
        try:
            if value is not None and not isinstance(json.loads(value), dict):
                raise ValueError
        except ValueError:
            raise SystemExit(f"{flag} must be a JSON object, got {value!r}") from None
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    sides = {"A": (args.a, args.llm_kwargs), "B": (args.b, args.b_llm_kwargs or args.llm_kwargs)}
    print("warm-up round (fills each checkout's compile cache) ...", file=sys.stderr, flush=True)
    for checkout, kwargs in sides.values():
        run_child(checkout, args.cache_root, kwargs, args.sampled)
    rounds: list[dict[str, dict[str, list[float]]]] = []
    for r in range(args.rounds):
        order = ("A", "B") if r % 2 == 0 else ("B", "A")
        rounds.append({})
        for name in order:
            checkout, kwargs = sides[name]
            print(f"round {r + 1}/{args.rounds}: {name} ({checkout}) ...", file=sys.stderr, flush=True)
            rounds[-1][name] = run_child(checkout, args.cache_root, kwargs, args.sampled)
    print(f"A = {args.a} {sides['A'][1]}\nB = {args.b} {sides['B'][1]}\n")
    print(summary_table(rounds))


def summary_table(rounds: list[dict[str, dict[str, list[float]]]]) -> str:
    """The markdown table of per-round step times ({"A": {bucket: [seconds]}, "B": ...} per round): medians over
    all rounds, B / A, the range of each round's own B / A, and the largest over the smallest of A's round medians
    (how far one checkout's processes differ: the noise a B / A must clear)."""
    buckets = sorted(set.intersection(*(set(r[s]) for r in rounds for s in ("A", "B"))),
                     key=lambda b: (not b.startswith("prefill"), len(b), b))
    lines = ["| bucket graph | steps (A / B) | A median (ms) | B median (ms) | B / A | B / A by round | A's rounds, max / min |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for b in buckets:
        a_all, b_all = ([t for r in rounds for t in r[s][b]] for s in ("A", "B"))
        a_ms, b_ms = statistics.median(a_all) * 1e3, statistics.median(b_all) * 1e3
        per_round = [statistics.median(r["B"][b]) / statistics.median(r["A"][b]) for r in rounds]
        a_rounds = [statistics.median(r["A"][b]) for r in rounds]
        lines.append(f"| {b} | {len(a_all)} / {len(b_all)} | {a_ms:.2f} | {b_ms:.2f} | {b_ms / a_ms:.3f} | "
                     f"{min(per_round):.3f}-{max(per_round):.3f} | {max(a_rounds) / min(a_rounds):.3f} |")
    return "\n".join(lines)

if __name__ == "__main__":
    main()
