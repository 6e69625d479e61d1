"""KV offloading's two measurements (issue 46), offline on the bundled model (or --model), compiled graphs:

    python benchmarks/kv_offload.py [--prefixes 8] [--prefix-len 1024] [--pool-tokens 3072] [--rounds 2]

1. A pool too small for the prefixes: `--prefixes` distinct system prompts of `--prefix-len` tokens, each asked a
   different 32-token question, round-robin for `--rounds` rounds, one request at a time, so the pool (of
   `--pool-tokens`) has always evicted the next prompt's prefix. TTFT (a 1-token generation's latency) per
   request, without the tier and with it (a fresh folder), rounds after the first.
2. A restart: a new engine on the warm folder, the first round again: its TTFT against the first round of the
   engine that started on a cold folder.
Each arm runs in its own process (an engine per process), one after the other on the same machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

ARM = r"""
import json, sys, time
from vllm_neuron import LLM, SamplingParams
a = json.loads(sys.argv[1])
kw = dict(num_gpu_blocks_override=a["blocks"], max_model_len=a["max_model_len"], max_num_seqs=4)
if a["tier"]:
    kw["kv_offloading_size"] = 4.0
llm = LLM(a["model"], **kw)
sp = SamplingParams(max_tokens=1, temperature=0)
for w in a["warm"]:  # requests outside the figures: a prompt of the same length, then one with its prefix cached
    llm.generate({"prompt_token_ids": w}, sp, use_tqdm=False)
out = []
for r in range(a["rounds"]):
    for p in a["prompts"]:
        t0 = time.perf_counter()
        o = llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0]
        out.append([r, time.perf_counter() - t0, o.num_cached_tokens, o.outputs[0].token_ids[0]])
print("RESULT " + json.dumps(out))
"""


def run_arm(args, prompts, warm, tier: str | None, rounds: int) -> list:
    spec = {"model": args.model, "blocks": args.pool_tokens // 16 + 1, "max_model_len": args.max_model_len,
            "tier": tier is not None, "prompts": prompts, "warm": warm, "rounds": rounds}
    env = dict(os.environ)
    if tier is not None:
        env["VLLM_NEURON_KV_OFFLOAD_DIR"] = tier
    proc = subprocess.run([sys.executable, "-c", ARM, json.dumps(spec)], env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-4000:])
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a local model (default: the bundled SmolLM2-135M)")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--pool-tokens", type=int, default=3072)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = []
    for _ in range(args.prefixes):
        prefix = [rng.randrange(100, 49000) for _ in range(args.prefix_len)]
        prompts.append(prefix + [rng.randrange(100, 49000) for _ in range(32)])
    w = [rng.randrange(100, 49000) for _ in range(args.prefix_len + 32)]
    warm = [w, w[:args.prefix_len] + [rng.randrange(100, 49000) for _ in range(32)]]
    with tempfile.TemporaryDirectory(prefix="kv-tier-bench-") as tier:
        arms = {"off": run_arm(args, prompts, warm, None, args.rounds),
                "tier (cold folder)": run_arm(args, prompts, warm, tier, args.rounds),
                "restart (warm folder)": run_arm(args, prompts, warm, tier, 1)}
        files = sum(len(fs) for _, _, fs in os.walk(tier))
    off, on, restart = arms.values()
    assert [x[3] for x in off] == [x[3] for x in on] and [x[3] for x in restart] == [x[3] for x in on[:len(prompts)]], \
        "the first tokens differ between arms"

    def med(rows, first_round: bool) -> tuple[float, float]:
        sel = [x for x in rows if (x[0] == 0) == first_round]
        return statistics.median(x[1] for x in sel) * 1e3, statistics.mean(x[2] for x in sel)

    print(f"{args.prefixes} prompts of {args.prefix_len}+32 tokens round-robin, pool {args.pool_tokens} tokens, "
          f"{files} block files written; median TTFT (ms) and mean cached tokens per request")
    print("| arm | round 1 TTFT | cached | later rounds TTFT | cached |")
    print("| --- | --- | --- | --- | --- |")
    for name, rows in arms.items():
        (t1, c1), later = med(rows, True), (med(rows, False) if any(x[0] for x in rows) else (float("nan"), 0))
        print(f"| {name} | {t1:.1f} | {c1:.0f} | {later[0]:.1f} | {later[1]:.0f} |")
    print(f"later rounds, tier / off: {med(on, False)[0] / med(off, False)[0]:.2f}x; first round after a restart, "
          f"warm / cold folder: {med(restart, True)[0] / med(on, True)[0]:.2f}x")


if __name__ == "__main__":
    main()
