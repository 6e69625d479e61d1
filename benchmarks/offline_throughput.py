"""Offline throughput: vllm-neuron's LLM.generate vs transformers' generate and OpenVINO GenAI, same prompts,
same run.

A fixed random workload (prompt and output lengths drawn with a seed) on the bundled model by default.
Every engine generates exactly the requested number of tokens per request (ignore EOS, greedy);
transformers runs batches of --hf-batch-size with left padding; OpenVINO GenAI runs its
ContinuousBatchingPipeline on the same token ids with the same --max-num-seqs, in its own venv (installed
on first use under --cache-dir, the model exported there with optimum-intel in the matching weight
precision: fp16 storage for our bf16 / fp32, int8 or int4 for our neuron_config.quantization). Prints output
tokens/s of each and our ratio to each.

    python benchmarks/offline_throughput.py [--model PATH] [--num-prompts 64] [--dtype auto] [--peers transformers,openvino]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers.install import default_cache_dir, ensure_installed  # noqa: E402
from peers.openvino_peer import exported_model, install_openvino_genai, run_offline  # noqa: E402

PEERS = ("transformers", "openvino")


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


def run_openvino(args, reqs, quantization: str | None) -> tuple[str, float, int]:
    """(row label, seconds, output tokens) of OpenVINO GenAI on the same requests."""
    from vllm_neuron.model.loader import bundled_model_path

    weights = args.openvino_weights if args.openvino_weights != "auto" else (quantization or "fp16")
    inst = ensure_installed("openvino", install_openvino_genai, args.cache_dir)
    print(f"  openvino: {'installed now' if inst.fresh else 'cached'} ({inst.info['version']}); exporting "
          f"{weights} weights (first use only) ...", flush=True)
    model_dir = exported_model(inst.info, os.path.abspath(args.model or bundled_model_path()), weights,
                               os.path.join(args.cache_dir, "openvino", "export.log"))
    r = run_offline(inst.info, model_dir, reqs, args.max_num_seqs, len(os.sched_getaffinity(0)), args.openvino_props)
    props = "".join(f", {k}={v}" for k, v in args.openvino_props.items())
    return (f"OpenVINO GenAI ContinuousBatchingPipeline ({inst.info['version'].split()[-1]}, {weights} weights{props})",
            r["seconds"], r["output_tokens"])


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
    p.add_argument("--skip-transformers", action="store_true", help="same as leaving transformers out of --peers")
    p.add_argument("--peers", default=",".join(PEERS), help="comma list of " + ", ".join(PEERS) + " (or none)")
    p.add_argument("--openvino-weights", choices=("auto", "fp16", "int8", "int4"), default="auto",
                   help="OpenVINO's weight format (auto: int8 / int4 as our neuron_config.quantization, else fp16)")
    p.add_argument("--openvino-props", type=json.loads, default={},
                   help='extra OpenVINO CPU properties, e.g. \'{"DYNAMIC_QUANTIZATION_GROUP_SIZE": 0, '
                        '"KV_CACHE_PRECISION": "bf16"}\' (its own defaults otherwise)')
    p.add_argument("--skip-ours", action="store_true", help="run the peers only (their own settings' A/B)")
    p.add_argument("--cache-dir", default=default_cache_dir(), help="peer installs (%(default)s)")
    args = p.parse_args()
    peers = [x for x in args.peers.split(",") if x and x != "none"]
    bad = [x for x in peers if x not in PEERS]
    if bad:
        p.error(f"--peers: unknown {bad}; valid: {', '.join(PEERS)}")
    if args.skip_transformers and "transformers" in peers:
        peers.remove("transformers")
    quantization = ((args.additional_config or {}).get("neuron_config") or {}).get("quantization")

    from vllm_neuron.config.device import resolve_dtype, resolve_device
    from vllm_neuron.model.loader import load_tokenizer

    dtype = resolve_dtype(args.dtype, resolve_device("cpu"))
    reqs = workload(load_tokenizer(args.model), args.num_prompts, args.seed, tuple(args.input_len_range),
                    tuple(args.output_len_range))
    print(f"workload: {len(reqs)} requests, {sum(len(i) for i, _ in reqs)} prompt tokens, "
          f"{sum(o for _, o in reqs)} output tokens, dtype {dtype}")
    rows = []
    if not args.skip_ours:
        ours_s, ours_tok = run_ours(args, reqs)
        rows.append((f"vllm-neuron LLM.generate ({quantization or str(dtype).removeprefix('torch.')})", ours_s, ours_tok))
    if "transformers" in peers:
        hf_s, hf_tok = run_transformers(args, reqs, dtype)
        rows.append((f"transformers generate (batch {args.hf_batch_size})", hf_s, hf_tok))
    if "openvino" in peers:
        try:
            rows.append(run_openvino(args, reqs, quantization))
        except Exception as e:  # noqa: BLE001 (a peer that cannot install or run is reported; ours still is)
            print(f"  openvino: failed: {' '.join(str(e).split())[:400]}", flush=True)
    print("\n| engine | time (s) | output tokens | output tok/s | vllm-neuron / this |\n| --- | --- | --- | --- | --- |")
    ours_rate = None if args.skip_ours else rows[0][2] / rows[0][1]
    for name, s, tok in rows:
        ratio = "-" if ours_rate is None or name == rows[0][0] else f"{ours_rate / (tok / s):.2f}x"
        print(f"| {name} | {s:.1f} | {tok} | {tok / s:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
