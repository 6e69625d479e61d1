"""Step 6: warm restart. `vllm-neuron compile` twice on the tiny model with one compile cache: the second run
must load every graph (0 compiled now) and size the same KV pool."""
import json
import os
import re
import subprocess
import sys

import gpucommon as G

MODEL = os.environ.get("TINY_DIR", "/tmp/tiny")
DEV = os.environ.get("WARM_DEVICE", "cuda")
TIMEOUT = float(os.environ.get("WARM_TIMEOUT", "200"))
G.banner("step 6: warm restart from the compile cache")
cmd = [sys.executable, "-m", "vllm_neuron.entrypoints.cli.main", "compile", MODEL, "--device", DEV,
       "--max-model-len", "256", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--block-size", "16",
       "--additional-config", json.dumps({"neuron_config": {"num_seqs_buckets": [1, 4],
                                                            "num_batched_tokens_buckets": [64]}})]
runs = []
for i in range(2):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        print(f"run {i + 1}: timed out after {TIMEOUT:.0f} s (WARM_TIMEOUT)")
        runs.append((None, None))
        break
    out = p.stdout + p.stderr
    m = re.search(r"(\d+) graphs, (\d+) compiled now, (\d+) already cached", out)
    pool = re.search(r"KV pool: (\d+) blocks", out)
    fallback = "ahead-of-time compilation failed" in out
    print(f"run {i + 1}: rc={p.returncode} {m.group(0) if m else 'no summary'}; "
          f"{pool.group(0) if pool else 'no pool line'}; aot failed: {fallback}")
    if p.returncode != 0 or not m:
        print(out[-3000:])
    runs.append((m, pool))
ok = len(runs) == 2 and all(m for m, _ in runs) and runs[1][0].group(2) == "0" and runs[0][1] and runs[1][1] \
    and runs[0][1].group(1) == runs[1][1].group(1)
warm = runs[1][0].group(0) if len(runs) == 2 and runs[1][0] else "no summary"
G.save_json("warm", {"ok": bool(ok), "second_run": warm})
G.result("6 warm restart loads every graph", bool(ok), warm)
