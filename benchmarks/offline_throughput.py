"""Offline throughput: vllm-neuron's LLM.generate vs transformers' generate, same prompts, same run.

A fixed random workload (prompt and output lengths drawn with a seed) on the bundled model by default.
Both engines generate exactly the requested number of tokens per request (ignore EOS); transformers
runs batches of --hf-batch-size with left padding. Prints output tokens/s for both and the ratio.

    python benchmarks/offline_throughput.py [--model PATH] [--num-prompts 64] [--dtype auto]
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch


def workload(tokenizer, n: int, seed: int, in_range: tuple[int, int], out_range: tuple[int, int]):
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    special = set(tokenizer.all_special_ids)
    reqs = []
    for _ in range(n):
        plen, olen = rng.randint(*in_range), rng.randint(*out_range)
        ids = []
        while len(ids) < plen:
            t = rng.randrange(vocab)
            if t not in special:
                ids.append(t)
        reqs.append((ids, olen))
    return reqs


def run_ours(args, reqs) -> tuple[float, int]:
    from vllm_neuron import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              enforce_eager=args.enforce_eager, additional_config=args.additional_config)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # first-touch warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def run_transformers(args, reqs, dtype: torch.dtype) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    from vllm_neuron.model.loader import load_checkpoint

    # The same dequantized weights we serve, in the same dtype (transformers' own GGUF path keeps the
    # weights quantized and computes in fp32: a different, slower model).
    ckpt = load_checkpoint(args.model)
    model = AutoModelForCausalLM.from_config(ckpt.hf_config, dtype=dtype)
    missing, unexpected = model.load_state_dict(dict(ckpt.iter_weights(dtype)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.eval()
    pad = 0
    total = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), args.hf_batch_size):
            batch = reqs[i:i + args.hf_batch_size]
            width = max(len(ids) for ids, _ in batch)
            new = max(o for _, o in batch)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids, _ in batch])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
            model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
            total += sum(o for _, o in batch)  # useful tokens only: padding work is not credited
            print(f"  transformers batch {i // args.hf_batch_size + 1}: {time.perf_counter() - t0:.1f} s", flush=True)
    return time.perf_counter() - t0, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF dir or .gguf (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len-range", type=int, nargs=2, default=[32, 256])
    p.add_argument("--output-len-range", type=int, nargs=2, default=[32, 128])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--additional-config", type=json.loads, default=None,
                   help='e.g. \'{"neuron_config": {"num_seqs_buckets": [1, 4, 16]}}\'')
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--skip-transformers", action="store_true")
    args = p.parse_args()

    from vllm_neuron.config.device import resolve_dtype, resolve_device
    from vllm_neuron.model.loader import load_tokenizer

    dtype = resolve_dtype(args.dtype, resolve_device("cpu"))
    reqs = workload(load_tokenizer(args.model), args.num_prompts, args.seed, tuple(args.input_len_range),
                    tuple(args.output_len_range))
    print(f"workload: {len(reqs)} requests, {sum(len(i) for i, _ in reqs)} prompt tokens, "
          f"{sum(o for _, o in reqs)} output tokens, dtype {dtype}")
    ours_s, ours_tok = run_ours(args, reqs)
    rows = [("vllm-neuron LLM.generate", ours_s, ours_tok)]
    if not args.skip_transformers:
        hf_s, hf_tok = run_transformers(args, reqs, dtype)
        rows.append((f"transformers generate (batch {args.hf_batch_size})", hf_s, hf_tok))
    print(f"\n| engine | time (s) | output tokens | output tok/s |\n| --- | --- | --- | --- |")
    for name, s, tok in rows:
        print(f"| {name} | {s:.1f} | {tok} | {tok / s:.1f} |")
    if len(rows) == 2:
        print(f"\nratio vllm-neuron / transformers: {(rows[0][2] / rows[0][1]) / (rows[1][2] / rows[1][1]):.2f}x")


if __name__ == "__main__":
    main()
