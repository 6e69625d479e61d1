"""The closing table: the issue's measures and targets from the steps' JSON files in $OUT."""
import json
import os

OUT = os.environ.get("OUT", "/tmp/out")


def load(name):
    try:
        with open(os.path.join(OUT, f"{name}.json")) as f:
            return json.load(f)
    except OSError:
        return {}


speed, parity, warm = load("speed"), load("parity"), load("warm")


def fmt(v, spec):
    return spec % v if v is not None else "not run"


rows = [
    ("batch-1 TPOT, 128-token prompt, 256 out (bf16, 1B shape)",
     fmt(speed.get("tpot_ms"), "%.3f ms") + (f" = {speed['pct_roofline']:.0f}% of roofline"
                                            if "pct_roofline" in speed else ""),
     fmt(speed.get("hf_tpot_ms"), "%.1f ms"), "<= 1.0 ms"),
    ("64 prompts of 256 -> 128 tokens, output tok/s", fmt(max(speed["ours_tok_s"]) if speed.get("ours_tok_s")
                                                          else None, "%.0f"),
     fmt(speed.get("hf_tok_s"), "%.0f"), ">= 20,000"),
    ("decode_b1 graph alone", fmt(speed.get("graph_b1_ms"), "%.3f ms/step"), "", ""),
    ("fp32 greedy parity (tiny Llama, compiled)", parity.get("summary", "not run"), "", "8/8"),
    ("warm restart (compile twice)", warm.get("second_run", "not run"), "", "0 compiled now"),
]
w = [max(len(r[i]) for r in rows + [("measure", "ours", "transformers", "target")]) for i in range(4)]
print("\n| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(("measure", "ours", "transformers", "target"))) + " |")
print("| " + " | ".join("-" * w[i] for i in range(4)) + " |")
for r in rows:
    print("| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |")
