"""Speculative decoding on the bundled model (n-gram, EAGLE3, DFlash): TPOT and output tok/s with speculation off
and on, acceptance rate and acceptance length, on a repetitive and a random workload, at batch 1 and 8 -
all in one run, one process, so the ratios are comparable.

    python benchmarks/spec_decode_ngram.py                      # K=4, lookup 2..5, 8 requests per cell
    python benchmarks/spec_decode_ngram.py --num-requests 16 --k 3 --output-len 96
    python benchmarks/spec_decode_ngram.py --methods ngram,eagle3 --eagle3-draft DIR
    python benchmarks/spec_decode_ngram.py --methods dflash --dflash-draft DIR
    python benchmarks/spec_decode_ngram.py --smoke                # eager, 8 requests x 16 tokens: checks it runs

Workloads: "repetitive" asks the model (chat template) to repeat a passage word for word, the work n-gram
lookup is for (editing, extraction, code); "random" sends random token prompts, where lookup finds
nothing and speculation should cost nothing. Greedy, so every engine emits the same tokens; the
repetitive requests stop at EOS (what the model writes after the passage is new text, not the work
lookup is for; --repetitive-ignore-eos runs them to --output-len), the random ones run to --output-len.
"sampled" sends the random prompts at temperature 1 (seeded): SmolLM2 stops repeating itself, lookup still
finds short matches and most drafts are rejected - the low-acceptance case for n-gram.
Batch B: B requests submitted together, the next wave when all finished.
TPOT = (E2E - TTFT) / (output tokens - 1) per request, averaged; tok/s = output tokens / wall time.
EAGLE3 without --eagle3-draft uses a random-weight draft head built for the bundled model (no trained
EAGLE3 draft exists for it): it accepts almost nothing, so it measures what a low-acceptance draft costs.
DFlash without --dflash-draft likewise uses a random-weight two-layer block draft (taps 1, 14, 27).
Low acceptance: a request whose drafts are mostly rejected stops speculating for a while and probes
again later (core/spec_policy.py); the "paused" column counts those pauses in the cell.
Timings on a shared machine are noisy: compare the on/off columns of one run only.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

PASSAGES = [
    "The harbour was quiet in the early morning. Fishing boats rocked gently against the wooden pier, and "
    "the smell of salt and diesel hung in the cool air. An old man in a yellow coat untangled his nets while "
    "gulls circled overhead, waiting for scraps. Across the water, the lighthouse blinked its last slow "
    "signal before the sun rose over the hills and painted the town in shades of orange and gold.",
    "To install the package, first create a virtual environment and activate it. Then run the installer "
    "with the default options and wait until it finishes. If the installer reports a missing compiler, "
    "install the build tools for your platform and run it again. Finally, check the installation by "
    "printing the version number; it should match the release notes of the version you downloaded.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i])\n            i += 1\n        else:\n"
    "            out.append(b[j])\n            j += 1\n    out.extend(a[i:])\n    out.extend(b[j:])\n"
    "    return out\n",
]


def repetitive_prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text = PASSAGES[i % len(PASSAGES)]
        msgs = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{text}"}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def run_cell(llm, prompts: list[list[int]], batch: int, output_len: int, ignore_eos: bool = True,
             temperature: float = 0.0) -> dict:
    from vllm_neuron import SamplingParams

    engine = llm.llm_engine
    stats, policy = engine.core.scheduler.spec_stats, engine.core.scheduler.spec_policy
    d0, t0_, a0, p0 = stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, policy.num_pauses
    tpots, total_out = [], 0
    t_start = time.perf_counter()
    for w in range(0, len(prompts), batch):
        start, first, n_out = {}, {}, {}
        for i, p in enumerate(prompts[w:w + batch]):
            rid = f"r{w + i}"
            params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=ignore_eos,
                                    seed=w + i if temperature > 0 else None)
            engine.add_request(rid, {"prompt_token_ids": p}, params)
            start[rid] = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                first.setdefault(out.request_id, now)
                if out.finished:
                    n = len(out.outputs[0].token_ids)
                    n_out[out.request_id] = n
                    total_out += n
                    if n > 1:
                        tpots.append((now - first[out.request_id]) / (n - 1))
    wall = time.perf_counter() - t_start
    drafts, dtoks, acc = stats.num_drafts - d0, stats.num_draft_tokens - t0_, stats.num_accepted_tokens - a0
    return {"tpot_ms": 1000 * statistics.mean(tpots), "tok_s": total_out / wall,
            "acceptance": acc / dtoks if dtoks else None, "length": 1 + acc / drafts if drafts else None,
            "paused": policy.num_pauses - p0, "tokens": total_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=8, help="requests per (workload, batch) cell")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--methods", default="ngram", help="comma list of ngram, eagle3, dflash")
    ap.add_argument("--eagle3-draft", default=None, help="EAGLE3 draft directory (default: a random-weight one)")
    ap.add_argument("--dflash-draft", default=None, help="DFlash draft directory (default: a random-weight one)")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--repetitive-ignore-eos", action="store_true",
                    help="the repetitive workload runs to --output-len past EOS too (by default it stops at EOS: "
                         "what follows the repeated passage is new text, not repetitive work)")
    ap.add_argument("--smoke", action="store_true",
                    help="a short check that the benchmark runs: eager, 8 requests x 16 tokens, 64-token random prompts")
    args = ap.parse_args()
    if args.smoke:
        args.enforce_eager = True
        args.num_requests, args.output_len, args.random_input_len = 8, 16, 64
    batches = [int(b) for b in args.batches.split(",")]

    from vllm_neuron import LLM

    # A fixed KV size: both engines then share one compile-cache entry (a budget-sized pool differs between
    # the two, and a different KV size recompiles every graph).
    common = dict(max_model_len=1024, max_num_seqs=max(batches), max_num_batched_tokens=512, num_gpu_blocks_override=512,
                  enforce_eager=args.enforce_eager, additional_config={"neuron_config": {
                      "num_seqs_buckets": sorted(set(batches)), "num_batched_tokens_buckets": [128, 512]}})
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
                       "prompt_lookup_max": args.lookup_max},
             "eagle3": {"method": "eagle3", "num_speculative_tokens": args.k, "model": args.eagle3_draft},
             "dflash": {"method": "dflash", "num_speculative_tokens": args.k, "model": args.dflash_draft}}
    methods = args.methods.split(",")
    if "eagle3" in methods and args.eagle3_draft is None:
        specs["eagle3"]["model"] = random_eagle3_draft()
    if "dflash" in methods and args.dflash_draft is None:
        specs["dflash"]["model"] = random_dflash_draft()
    engines = {"off": LLM(**common), **{m: LLM(speculative_config=specs[m], **common) for m in methods}}
    tok = engines["off"].get_tokenizer()
    workloads = {"repetitive": repetitive_prompts(tok, args.num_requests),
                 "random": random_prompts(len(tok), args.num_requests, args.random_input_len, seed=0)}
    for llm in engines.values():  # warm both (first-call costs off the clock)
        run_cell(llm, workloads["random"][:1], 1, 4)
    rows = []
    workloads["sampled"] = workloads["random"]  # random prompts, temperature 1: lookup matches, drafts mostly miss
    for wname, prompts in workloads.items():
        for b in batches:
            ignore_eos = wname != "repetitive" or args.repetitive_ignore_eos
            temp = 1.0 if wname == "sampled" else 0.0
            res = {mode: run_cell(llm, prompts, b, args.output_len, ignore_eos, temp) for mode, llm in engines.items()}
            # Greedy (or a fixed length): every engine emits as many tokens, else the TPOTs are not comparable.
            if len({r["tokens"] for r in res.values()}) > 1:
                print(f"WARNING: output token counts differ between engines: {res}", flush=True)
            rows += [(m, wname, b, res["off"], res[m]) for m in methods]
            print(f"[cell] {wname} batch {b}: {res}", flush=True)
    print(f"\nSpeculation off vs on (K={args.k}; n-gram lookup {args.lookup_min}..{args.lookup_max}; EAGLE3 draft "
          f"{specs['eagle3']['model'] if 'eagle3' in methods else '-'}; DFlash draft "
          f"{specs['dflash']['model'] if 'dflash' in methods else '-'}), bundled model, "
          f"{args.num_requests} requests x up to {args.output_len} tokens per cell (repetitive: "
          f"{'past EOS' if args.repetitive_ignore_eos else 'until EOS'}), "
          f"{'eager' if args.enforce_eager else 'compiled'}")
    head = (f"{'method':<7} {'workload':<11} {'batch':>5} {'TPOT off':>9} {'TPOT on':>8} {'TPOT off/on':>11} "
            f"{'tok/s off':>9} {'tok/s on':>8} {'tok/s on/off':>12} {'accept %':>8} {'acc. len':>8} {'paused':>6}")
    print(head)
    print("-" * len(head))
    for m, wname, b, off, on in rows:
        acc = f"{100 * on['acceptance']:.1f}" if on["acceptance"] is not None else "-"
        length = f"{on['length']:.2f}" if on["length"] is not None else "-"
        print(f"{m:<7} {wname:<11} {b:>5} {off['tpot_ms']:>9.1f} {on['tpot_ms']:>8.1f} "
              f"{off['tpot_ms'] / on['tpot_ms']:>10.2f}x {off['tok_s']:>9.1f} {on['tok_s']:>8.1f} "
              f"{on['tok_s'] / off['tok_s']:>11.2f}x {acc:>8} {length:>8} {on['paused']:>6}")
    print("TPOT off/on > 1: speculation lowers TPOT; tok/s on/off > 1: it raises throughput. 'paused': requests "
          "whose drafts were mostly rejected stopped speculating for a while (core/spec_policy.py).")


def _factory():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tests.model_factory as factory

    return factory


def random_dflash_draft() -> str:
    """A random-weight two-layer DFlash draft shaped for the bundled SmolLM2-135M (30 layers; hidden 576, 9 heads /
    3 KV heads), block size 16, written once to a temporary directory."""
    import tempfile

    return _factory().make_tiny_dflash(tempfile.mkdtemp(prefix="dflash-random-"), hidden_size=576, num_heads=9,
                                       num_kv_heads=3, intermediate_size=1536, target_layer_ids=[1, 14, 27],
                                       block_size=16, scale=0.05)


def random_eagle3_draft() -> str:
    """A random-weight EAGLE3 draft head shaped for the bundled SmolLM2-135M (hidden 576, 9 heads / 3 KV
    heads), default taps; written once to a temporary directory."""
    import tempfile

    make_tiny_eagle3 = _factory().make_tiny_eagle3

    return make_tiny_eagle3(tempfile.mkdtemp(prefix="eagle3-random-"), target_hidden=576, hidden_size=576,
                            num_heads=9, num_kv_heads=3, intermediate_size=1536, draft_vocab_size=4096, scale=0.05)


if __name__ == "__main__":
    main()
