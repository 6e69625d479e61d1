"""`vllm-neuron`: serve | generate | compile | bench serve."""
from __future__ import annotations

import argparse
import sys

from vllm_neuron.config.arg_utils import HelpFormatter, add_engine_args, add_server_args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-neuron", description="vLLM Neuron's design on PyTorch devices")
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible server (default: the bundled SmolLM2-135M-Instruct)",
                           description="Serve a model over vLLM's OpenAI-compatible HTTP API.",
                           formatter_class=HelpFormatter)
    add_engine_args(serve)
    add_server_args(serve)

    gen = sub.add_parser("generate", help="generate from prompts offline and print the answers",
                         description="Load the model in this process, answer the prompts, print the answers. "
                         "Sampling defaults come from the model's generation config (see --generation-config).",
                         formatter_class=HelpFormatter)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt(s); chat-formatted unless --raw")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    s = gen.add_argument_group("Sampling (unset: the generation config's default, else vLLM's)")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="tokens to generate at most (default: the generation config's max_new_tokens, else 16)")
    s.add_argument("--temperature", type=float, default=None,
                   help="0 is greedy (default: the generation config's, else 1.0)")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: the generation config's, else 1.0)")
    s.add_argument("--top-k", type=int, default=None, help="0 is off (default: the generation config's, else 0)")
    add_engine_args(gen, model_positional=False)

    comp = sub.add_parser("compile", help="compile every bucket into the compile cache, then exit",
                          description="Fill the compile cache for a configuration, then exit: a later serve with "
                          "the same flags loads every graph without compiling.", formatter_class=HelpFormatter)
    add_engine_args(comp)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bserve = bsub.add_parser("serve", help="serving benchmark against an OpenAI-compatible server",
                             formatter_class=HelpFormatter)
    from vllm_neuron.benchmarks.serve import add_cli_args

    add_cli_args(bserve)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            from vllm_neuron.entrypoints.cli.serve import run_serve

            return run_serve(args)
        if args.command == "generate":
            from vllm_neuron.entrypoints.cli.offline import run_generate

            return run_generate(args)
        if args.command == "compile":
            from vllm_neuron.entrypoints.cli.offline import run_compile

            return run_compile(args)
        if args.command == "bench":
            from vllm_neuron.benchmarks.serve import main as bench_main

            result = bench_main(args)
            return 130 if result.get("interrupted") else 0  # 130: Ctrl-C, after the partial table
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
