"""int4 / int8 weights with activations made int8 (W4A8, W8A8: `neuron_config.int8_activations`, the default
where the CPU has AVX512-VNNI) against the same weights with full-precision activations and the unquantized
model: teacher-forced quality on English text, one run.

Each configuration scores the same passages (this repository's docs, cut into --tokens-token pieces) through
prompt log-probabilities: the perplexity of the text, and how often its most likely next token is the
unquantized model's. Each runs in a process of its own, in turn.

    python benchmarks/int8_activations.py [--passages 24] [--tokens 256]
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys

CONFIGS = {
    "unquantized": {},
    "int4, W4A16": {"quantization": "int4", "int8_activations": False},
    "int4, W4A8 (default)": {"quantization": "int4"},
    "int8, W8A16": {"quantization": "int8", "int8_activations": False},
    "int8, W8A8 (default)": {"quantization": "int8"},
}


def passages(tokenizer, count: int, tokens: int) -> list[list[int]]:
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs")
    ids: list[int] = []
    for path in sorted(glob.glob(os.path.join(root, "*.md"))):
        with open(path, encoding="utf-8") as f:
            ids += tokenizer.encode(f.read(), add_special_tokens=False)
    return [ids[i * tokens:(i + 1) * tokens] for i in range(min(count, len(ids) // tokens))]


def child(neuron_config: dict, count: int, tokens: int) -> None:
    from vllm_neuron import LLM, SamplingParams

    llm = LLM(max_model_len=max(1024, tokens + 16), additional_config={"neuron_config": neuron_config})
    texts = passages(llm.get_tokenizer(), count, tokens)
    outs = llm.generate([{"prompt_token_ids": t} for t in texts],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1), use_tqdm=False)
    result = []
    for t, o in zip(texts, outs):
        rows = []
        for pos, entry in enumerate(o.prompt_logprobs[1:], start=1):
            top = max(entry.items(), key=lambda kv: kv[1].logprob)[0]
            rows.append((entry[t[pos]].logprob, top))
        result.append(rows)
    print("RESULT " + json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--passages", type=int, default=24)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(json.loads(args.child), args.passages, args.tokens)
        return
    runs = {}
    for name, nc in CONFIGS.items():
        print(f"scoring: {name} ...", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(nc), "--passages", str(args.passages),
                               "--tokens", str(args.tokens)], capture_output=True, text=True, check=True)
        runs[name] = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    ref = [tok for rows in runs["unquantized"] for _, tok in rows]
    print(f"\n{args.passages} passages of {args.tokens} tokens\n")
    print("| configuration | perplexity | next-token top-1 = unquantized's |\n| --- | --- | --- |")
    for name, rows in runs.items():
        flat = [r for rs in rows for r in rs]
        ppl = math.exp(-sum(lp for lp, _ in flat) / len(flat))
        agree = sum(top == r for (_, top), r in zip(flat, ref)) / len(flat)
        print(f"| {name} | {ppl:.3f} | {agree:.1%} |")


if __name__ == "__main__":
    main()
