"""`vllm-neuron generate` and `vllm-neuron compile`: the offline engine from the command line."""
from __future__ import annotations

import argparse

from vllm_neuron.config.arg_utils import engine_config_from_args


def run_generate(args: argparse.Namespace) -> int:
    from vllm_neuron.entrypoints.llm import LLM
    from vllm_neuron.sampling_params import SamplingParams

    llm = LLM.from_config(engine_config_from_args(args))
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

    config = engine_config_from_args(args)
    if config.data_parallel_size > 1:  # the replicas' graphs: each replica's KV share sizes its pool
        from vllm_neuron.engine.replica import host_placements, placement_config

        placement_config(config, host_placements(config, range(max(config.local_dp_replicas, 1)))[0])
    core = EngineCore(config)
    c = core.compiler
    print(f"compile cache {c.dir}: {len(c.records)} graphs, {c.num_compiled} compiled now, "
          f"{len(c.records) - c.num_compiled} already cached")
    return 0
