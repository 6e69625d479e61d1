"""`vllm-neuron generate` and `vllm-neuron compile`: the offline engine from the command line."""
from __future__ import annotations

import argparse

from vllm_neuron.config.arg_utils import engine_args_from_cli


def run_generate(args: argparse.Namespace) -> int:
    from vllm_neuron.entrypoints.llm import LLM
    from vllm_neuron.sampling_params import SamplingParams

    llm = LLM.from_engine_args(engine_args_from_cli(args))
    defaults = llm.get_default_sampling_params()
    kwargs = {n: getattr(defaults, n) for n in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                                "repetition_penalty")}
    kwargs.update({n: getattr(args, n) for n in ("max_tokens", "temperature", "top_p", "top_k")
                   if getattr(args, n) is not None})
    params = SamplingParams(**kwargs)
    if args.raw:
        outs = llm.generate(list(args.prompts), params)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    for prompt, out in zip(args.prompts, outs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text}")
    return 0


def run_compile(args: argparse.Namespace) -> int:
    from vllm_neuron.engine.core import EngineCore
    from vllm_neuron.engine.resolve import resolve_engine_config

    # With data parallelism the resolved config holds each replica's KV share, which sizes the graphs' pool.
    core = EngineCore(*resolve_engine_config(engine_args_from_cli(args)))
    c = core.compiler
    print(f"compile cache {c.dir}: {len(c.records)} graphs, {c.num_compiled} compiled now, "
          f"{len(c.records) - c.num_compiled} already cached")
    return 0
