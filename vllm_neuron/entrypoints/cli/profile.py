"""`vllm-neuron profile`: a short offline workload under torch.profiler, then the per-bucket table.

The engine runs in this process (LLM); one unprofiled pass of the same workload shape (other prompts, so the
profiled one does not come from the prefix cache) loads or compiles the graphs first. The traces stay in
--profile-dir (Perfetto / chrome://tracing read them); entrypoints/cli/trace_report.py reads the engine's.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

from vllm_neuron.config.arg_utils import engine_args_from_cli
from vllm_neuron.entrypoints.cli.offline import _log_to_stderr
from vllm_neuron.entrypoints.cli.trace_report import analyze, format_report


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Profiled workload")
    g.add_argument("--num-prompts", type=int, default=8, help="prompts in the profiled run, all submitted at once")
    g.add_argument("--input-len", type=int, nargs="+", default=[100],
                   help="prompt lengths in tokens (random tokens), taken in turn by the prompts")
    g.add_argument("--output-len", type=int, default=32, help="tokens generated per prompt (EOS ignored)")
    g.add_argument("--no-warmup", action="store_true",
                   help="profile the first run too (graph compilation and cache loads included)")
    g.add_argument("--profile-dir", default=None,
                   help="folder for the traces (default: $VLLM_TORCH_PROFILER_DIR, else a new temporary folder)")
    g.add_argument("--top-ops", type=int, default=3, help="ops listed per bucket, by self time inside its graph")
    g.add_argument("--with-stack", action="store_true",
                   help="record Python stacks (VLLM_TORCH_PROFILER_WITH_STACK; off here, it inflates host time)")
    g.add_argument("-v", "--verbose", action="store_true", help="the engine's log on stderr, as serve prints it")


def _prompts(n: int, lengths: list[int], vocab: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(lengths[i % len(lengths)])]}
            for i in range(n)]


def _check(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "output_len", "top_ops"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(n < 1 for n in args.input_len):
        raise ValueError(f"--input-len values must be >= 1, got {args.input_len}")


def run_profile(args: argparse.Namespace) -> int:
    from vllm_neuron.entrypoints.llm import LLM
    from vllm_neuron.sampling_params import SamplingParams

    _check(args)
    _log_to_stderr(args.verbose)
    folder = args.profile_dir or os.environ.get("VLLM_TORCH_PROFILER_DIR") or tempfile.mkdtemp(prefix="vllm_neuron_profile_")
    os.environ["VLLM_TORCH_PROFILER_DIR"] = folder
    os.environ["VLLM_TORCH_PROFILER_WITH_STACK"] = "1" if args.with_stack else "0"
    llm = LLM.from_engine_args(engine_args_from_cli(args))
    vocab = len(llm.get_tokenizer())
    too_long = [n for n in args.input_len if n + args.output_len > llm.llm_engine.config.max_model_len] \
        if llm.llm_engine is not None else []
    if too_long:
        raise ValueError(f"--input-len {too_long} + --output-len {args.output_len} exceed max_model_len="
                         f"{llm.llm_engine.config.max_model_len}")
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    if not args.no_warmup:
        llm.generate(_prompts(args.num_prompts, args.input_len, vocab, seed=1), params, use_tqdm=False)
    llm.start_profile()
    t0 = time.perf_counter()
    outs = llm.generate(_prompts(args.num_prompts, args.input_len, vocab, seed=2), params, use_tqdm=False)
    wall = time.perf_counter() - t0
    traces = llm.stop_profile()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"Profiled {args.num_prompts} prompts ({', '.join(map(str, args.input_len))} tokens) -> {args.output_len} "
          f"tokens each: {wall:.2f} s, {tokens / wall:.1f} output tok/s under the profiler")
    engines = [t for t in traces if ".engine" in os.path.basename(t)]
    for path in engines or traces:
        print(format_report(analyze(path), args.top_ops))
    print("Traces (Perfetto: https://ui.perfetto.dev, or chrome://tracing):", *traces, sep="\n  ")
    sys.stdout.flush()
    return 0
