"""`vllm-neuron generate` and `vllm-neuron compile`: the offline engine from the command line."""
from __future__ import annotations

import argparse
import os
import sys

from vllm_neuron.config.arg_utils import engine_args_from_cli
from vllm_neuron.config.engine_args import BUNDLED_MODEL_NAME
from vllm_neuron.logger import configure_root_logger


def _log_to_stderr(verbose: bool) -> None:
    """A command-line tool's streams: the log on stderr (warnings and errors only unless verbose), stdout for
    the answers. Through the environment, so that engine processes (tensor-parallel ranks, data-parallel
    replicas) do the same; a level the user set stays."""
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    if not os.environ.get("VLLM_NEURON_LOG_LEVEL", "").strip():
        os.environ["VLLM_NEURON_LOG_LEVEL"] = "INFO" if verbose else "WARNING"
    configure_root_logger()


def run_generate(args: argparse.Namespace) -> int:
    from vllm_neuron.entrypoints.llm import LLM
    from vllm_neuron.sampling_params import SamplingParams

    _log_to_stderr(args.verbose)
    engine_args = engine_args_from_cli(args)
    if not args.verbose:  # the first run on a machine builds kernels and compiles graphs: minutes without a word
        model = engine_args.model or f"the bundled {BUNDLED_MODEL_NAME}"
        print(f"Loading {model} (-v shows the engine's log; the first run on a machine builds kernels and compiles "
              "graphs, which takes minutes)", file=sys.stderr, flush=True)
    llm = LLM.from_engine_args(engine_args)
    defaults = llm.get_default_sampling_params()
    kwargs = {n: getattr(defaults, n) for n in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                                "repetition_penalty")}
    kwargs.update({n: getattr(args, n) for n in ("max_tokens", "temperature", "top_p", "top_k")
                   if getattr(args, n) is not None})
    params = SamplingParams(**kwargs)
    if args.raw:
        outs = llm.generate(list(args.prompts), params, use_tqdm=args.verbose)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params, use_tqdm=args.verbose)
    if len(outs) == 1:
        print(outs[0].outputs[0].text)
        return 0
    for i, (prompt, out) in enumerate(zip(args.prompts, outs)):  # several: each answer under its prompt
        if i:
            print()
        print(f">>> {prompt}\n{out.outputs[0].text}")
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
