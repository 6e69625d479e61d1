"""`vllm-neuron generate` and `vllm-neuron compile`: the offline engine from the command line."""
from __future__ import annotations

import argparse

from vllm_neuron.config.arg_utils import engine_config_from_args


def run_generate(args: argparse.Namespace) -> int:
    from vllm_neuron.entrypoints.llm import LLM
    from vllm_neuron.sampling_params import SamplingParams

    llm = LLM.from_config(engine_config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k)
    if args.raw:
        outs = llm.generate(list(args.prompts), params)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params)
    for prompt, out in zip(args.prompts, outs):
        print(f"\n>>> {prompt}\n{out.outputs[0].text}")
    return 0


def run_compile(args: argparse.Namespace) -> int:
    from vllm_neuron.engine.core import EngineCore

    core = EngineCore(engine_config_from_args(args))
    c = core.compiler
    print(f"compile cache {c.dir}: {len(c.records)} graphs, {c.num_compiled} compiled now, "
          f"{len(c.records) - c.num_compiled} already cached")
    return 0
