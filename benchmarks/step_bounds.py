"""Each step kind of our engine against this machine's bound, in one run (`make bench-bounds`).

Measures the machine first, with nothing else of ours running: the matmul peak in the engine's dtype
(GFLOP/s of torch matmuls on large square shapes, every core: bf16 where the engine runs bf16, fp32 on
AVX2-only CPUs, where bf16 matmuls are emulated) and the read bandwidth (an fp32 sum of 1 GiB, in 2 MiB pages like
the engine's weights, measured again after the steps: the bounds take the higher figure, since a VM's bandwidth
moves by 2-3x within a minute and a bound the steps could beat bounds nothing). Then serves
the bundled model offline with the default buckets, times every step the model runner executes
(prefill at each prefill bucket; decode with 1, 4 and 16 sequences), and prints per step kind our
median step time next to its bound:

    bound = max(linear FLOPs of the step / matmul peak, bytes the step must read / bandwidth)

A step's linear FLOPs are 2 x (weights of every linear layer) x (rows of the bucket); its bytes are
every linear weight once (the embedding's rows are negligible) plus the KV cache the sequences read.
Attention FLOPs are left out of these rows (at most a few percent of the linears' at these lengths), so the
bound is optimistic.

Long context (`--long-context`, default 8192 tokens, 0 skips): one prompt that fills the context but for the
decode tokens, prefilled in segments and then decoded at batch 1. Prints the prefill against its bound (here
with the causal attention FLOPs, as large as the linears' at 8k) and attention's share of the decode step at
that context: (step at long context - step at short context) / step at long context, beside the time its KV
bytes take at the measured bandwidth.

    python benchmarks/step_bounds.py [--quantization int8] [--repeat 5] [--threads 2] [--decode-batches 1,4,16]
                                     [--long-context 8192]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers.report import measure_read_bandwidth  # noqa: E402
from step_timing import steps_of, time_steps  # noqa: E402


@dataclass(frozen=True)
class StepCost:
    flops: float
    bytes: float


def step_cost(linear_params: int, weight_bytes: int, rows: int, kv_bytes_per_token: int,
              context_tokens: int) -> StepCost:
    """What one step must do at least: `rows` rows through every linear layer, every weight read once,
    and `context_tokens` cached tokens' K and V read (pure)."""
    return StepCost(flops=2.0 * linear_params * rows, bytes=float(weight_bytes + kv_bytes_per_token * context_tokens))


def attention_flops(layers: int, heads: int, head_dim: int, tokens: int) -> float:
    """FLOPs of causal self-attention over a `tokens`-token prompt: QK^T and PV, half the square each (pure)."""
    return 2.0 * 2.0 * layers * heads * head_dim * tokens * tokens / 2.0


def bandwidth_for_bounds(before_b_s: float, after_b_s: float) -> float:
    """The read bandwidth the bounds use, of the probes before and after the steps: the higher (pure)."""
    return max(before_b_s, after_b_s)


def bound_ms(cost: StepCost, peak_flop_s: float, bandwidth_b_s: float) -> tuple[float, str]:
    """(bound in ms, which resource sets it) of a step (pure)."""
    compute, memory = cost.flops / peak_flop_s, cost.bytes / bandwidth_b_s
    return (compute * 1e3, "compute") if compute >= memory else (memory * 1e3, "memory")


def measure_matmul_peak(threads: int, n: int = 2048, repeats: int = 5, dtype: str = "bfloat16") -> float:
    """FLOP/s of an n x n x n matmul in `dtype` through torch with `threads` threads (best of N)."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype)
    try:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # oneDNN's first call picks and prepares its kernel
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return 2.0 * n**3 / best
    finally:
        torch.set_num_threads(old)


_SHORT = {"bfloat16": "bf16", "float32": "fp32"}


def peak_dtype(dtype: str, widens: bool) -> str:
    """The dtype whose matmul peak bounds the engine's steps (pure): its own, but fp32 where bf16 linears above
    the kernel's rows run in fp32 on widened weights (`widens`: KernelConfig.widen_bf16, the AVX2 class, where
    torch's bf16 matmul is emulated at a fraction of the fp32 peak)."""
    return "float32" if widens and dtype == "bfloat16" else dtype


def _model_sizes(model) -> tuple[int, int]:
    """(linear weight elements, their bytes as held) of the loaded model."""
    from vllm_neuron.model.layers.linear import Linear

    params = nbytes = 0
    for m in model.modules():
        if isinstance(m, Linear):
            params += m.in_features * m.out_features
            if m.quantization in ("int8", "int4"):  # the bands, or int4's tile copy where it replaced them
                held = [m.qweight, m.qscale] if hasattr(m, "qweight") else [m.qtiles, m.qtile_extra]
            else:
                held = [m.weight]
            nbytes += sum(t.numel() * t.element_size() for t in held)
    return params, nbytes


def _kv_bytes_per_token(llm) -> int:
    runner = llm.llm_engine.core.runner
    return sum(k[0].numel() * k.element_size() + v[0].numel() * v.element_size() for k, v in runner.kv_caches)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quantization", choices=("int8", "int4"), default=None, help="weight-only quantization")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="the engine's dtype, and so the peak's (auto: the engine's own choice for this CPU)")
    p.add_argument("--repeat", type=int, default=5, help="prefill steps per bucket")
    p.add_argument("--decode-tokens", type=int, default=32, help="output tokens per decode measurement")
    p.add_argument("--decode-batches", default="1,4,16", help="sequences decoding together")
    p.add_argument("--prefill-buckets", default=None, help="num_batched_tokens_buckets (default: the engine's)")
    p.add_argument("--decode-buckets", default=None, help="num_seqs_buckets (default: the engine's)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--model", default=None, help="model path (default: the bundled model)")
    p.add_argument("--eager", action="store_true", help="run the buckets uncompiled")
    p.add_argument("--matmul-size", type=int, default=2048, help="n of the n^3 peak matmul")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="GiB summed for the read bandwidth")
    p.add_argument("--long-context", type=int, default=8192,
                   help="context of the long-context prefill and decode (0 skips them)")
    args = p.parse_args(argv)

    import torch

    from vllm_neuron.config.device import resolve_dtype

    from vllm_neuron.model.layers.kernel_config import resolve_kernel_config

    cpu = torch.device("cpu")
    dtype = str(resolve_dtype(args.dtype, cpu)).removeprefix("torch.")
    compute = peak_dtype(dtype, resolve_kernel_config(cpu, getattr(torch, dtype)).widen_bf16)
    peak = measure_matmul_peak(args.threads, args.matmul_size, dtype=compute)
    bandwidth = measure_read_bandwidth(args.threads, args.bandwidth_gib)
    print(f"machine: {_SHORT[compute]} matmul peak {peak / 1e9:.0f} GFLOP/s ({args.matmul_size}^3, torch, {args.threads} "
          f"threads), read bandwidth {bandwidth / 1e9:.1f} GB/s (fp32 sum of {args.bandwidth_gib:g} GiB, "
          f"2 MiB pages where available)", flush=True)

    from vllm_neuron import LLM, SamplingParams
    from vllm_neuron.config.buckets import parse_bucket_name

    nc: dict = {"quantization": args.quantization} if args.quantization else {}
    kw: dict = {"model": args.model} if args.model else {}
    if args.prefill_buckets:
        nc["num_batched_tokens_buckets"] = [int(b) for b in args.prefill_buckets.split(",")]
        kw["max_num_batched_tokens"] = nc["num_batched_tokens_buckets"][-1]
    if args.decode_buckets:
        nc["num_seqs_buckets"] = [int(b) for b in args.decode_buckets.split(",")]
        kw["max_num_seqs"] = nc["num_seqs_buckets"][-1]
    llm = LLM(**kw, dtype=args.dtype, enable_prefix_caching=False, enforce_eager=args.eager,
              additional_config={"neuron_config": nc})
    runner = llm.llm_engine.core.runner
    params, weight_bytes = _model_sizes(runner.model)
    kv_per_token = _kv_bytes_per_token(llm)
    times = time_steps(llm)
    vocab = runner.ckpt.hf_config.vocab_size
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seed = 0

    def prompt(n: int) -> dict:
        nonlocal seed
        seed += 1
        return {"prompt_token_ids": [(seed * 7919 + 31 * i) % (vocab - 10) + 5 for i in range(n)]}

    context: dict[str, int] = {}
    for size in runner.prefill_buckets:  # one prompt filling the bucket exactly: one prefill step
        for _ in range(args.repeat + 1):
            llm.generate([prompt(size)], greedy, use_tqdm=False)
        name = runner._graph_name("prefill", size, 0)
        times[name] = times[name][1:]  # the first of each bucket may still pay a one-time cost
        context[name] = size
    decode_len = 32
    for batch in [int(b) for b in args.decode_batches.split(",")]:
        before = {k: len(v) for k, v in times.items()}
        llm.generate([prompt(decode_len) for _ in range(batch)],
                     SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True), use_tqdm=False)
        for name, v in times.items():
            if name.startswith("decode") and len(v) > before.get(name, 0) and name not in context:
                context[name] = batch * (decode_len + args.decode_tokens // 2)

    after = measure_read_bandwidth(args.threads, args.bandwidth_gib)
    before, bandwidth = bandwidth, bandwidth_for_bounds(bandwidth, after)
    print(f"read bandwidth after the steps {after / 1e9:.1f} GB/s (before {before / 1e9:.1f}); the bounds take "
          f"{bandwidth / 1e9:.1f}", flush=True)
    print(f"\n{args.model or 'bundled model'}, {args.quantization or str(runner.dtype).removeprefix('torch.')} weights "
          f"({weight_bytes / 1e6:.0f} MB, {params / 1e6:.0f} M linear weights), medians of every step")
    print("| step (bucket graph) | steps | median (ms) | bound (ms) | bound by | median / bound |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, v in sorted(times.items(), key=lambda kv: (not kv[0].startswith("prefill"), len(kv[0]), kv[0])):
        if not v or name not in context:
            continue
        rows = parse_bucket_name(name)[1]
        cost = step_cost(params, weight_bytes, rows, kv_per_token, context[name])
        b, by = bound_ms(cost, peak, bandwidth)
        med = statistics.median(v) * 1e3
        print(f"| {name} | {len(v)} | {med:.1f} | {b:.1f} | {by} | {med / b:.1f}x |")
    if args.long_context:
        _long_context(llm, times, prompt, args, peak, bandwidth, params, weight_bytes, kv_per_token)
    print("\n(Wall time of each step as the runner executes it, host work included; a loaded machine "
          "inflates the medians, not the bounds.)")


def _long_context(llm, times, prompt, args, peak: float, bandwidth: float, params: int, weight_bytes: int,
                  kv_per_token: int) -> None:
    """The long-context prefill and batch-1 decode against their bounds, and attention's share of the step."""
    from vllm_neuron import SamplingParams

    runner = llm.llm_engine.core.runner
    n = args.long_context - args.decode_tokens - 1
    if n + args.decode_tokens > runner.config.max_model_len:
        print(f"\nlong context skipped: {args.long_context} tokens exceed max_model_len={runner.config.max_model_len}")
        return
    short = statistics.median(steps_of(times, "decode", 1) or [float("nan")])
    before = {k: len(v) for k, v in times.items()}
    llm.generate([prompt(n)], SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True),
                 use_tqdm=False)
    new = {k: v[before.get(k, 0):] for k, v in times.items()}
    prefill = sum(t for k, v in new.items() if k.startswith("prefill") for t in v)
    decode = statistics.median([t for k, v in new.items() if k.startswith("decode") for t in v])
    hf = runner.ckpt.hf_config.get_text_config()
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    attn = attention_flops(hf.num_hidden_layers, hf.num_attention_heads, head_dim, n)
    pre_cost = StepCost(2.0 * params * n + attn, float(weight_bytes + kv_per_token * n))
    pre_bound, pre_by = bound_ms(pre_cost, peak, bandwidth)
    dec_bound, dec_by = bound_ms(step_cost(params, weight_bytes, 1, kv_per_token, n), peak, bandwidth)
    kv_ms = kv_per_token * n / bandwidth * 1e3
    print(f"\nLong context: one {n}-token prompt ({args.long_context} with its {args.decode_tokens} output tokens)")
    print("| step | measured (ms) | bound (ms) | bound by | measured / bound |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| prefill of {n} tokens (all segments; attention {attn / pre_cost.flops:.0%} of its FLOPs) | "
          f"{prefill * 1e3:.0f} | {pre_bound:.0f} | {pre_by} | {prefill * 1e3 / pre_bound:.1f}x |")
    print(f"| decode_b1 at {n} context (median) | {decode * 1e3:.1f} | {dec_bound:.1f} | {dec_by} | "
          f"{decode * 1e3 / dec_bound:.1f}x |")
    share = (decode - short) / decode
    print(f"Attention's share of the batch-1 decode step at {n} context: {share:.0%} ({(decode - short) * 1e3:.1f} ms "
          f"of {decode * 1e3:.1f} ms; the step at short context takes {short * 1e3:.1f} ms); its KV bytes "
          f"({kv_per_token * n / 1e6:.0f} MB) take {kv_ms:.1f} ms at the measured bandwidth")


if __name__ == "__main__":
    main()
