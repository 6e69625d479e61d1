"""`vllm-neuron`: serve | generate | compile | bench serve."""
from __future__ import annotations

import argparse
import sys

from vllm_neuron.config.arg_utils import add_engine_args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-neuron", description="vLLM Neuron's design on PyTorch devices")
    sub = p.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible server (default: the bundled SmolLM2-135M-Instruct)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(serve)
    g = serve.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes "
                   "(also read from VLLM_API_KEY)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--allowed-origins", nargs="*", default=None, help="CORS origins")
    from vllm_neuron.entrypoints.openai.request_policy import DEFAULT_MAX_N, DEFAULT_MAX_REQUEST_BODY_BYTES

    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a `chat_template` sent in a request (it runs on the server; refused otherwise)")
    g.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                   help="largest `n` (completions per request) a request may ask for; larger gets a 400")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies get a 413 before they are read")
    from vllm_neuron.tool_parsers import ToolParserManager

    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice="auto" (needs --tool-call-parser)')
    g.add_argument("--tool-call-parser", default=None, choices=ToolParserManager.names(),
                   help="how tool calls are read from the model's answer when tool_choice is auto")

    gen = sub.add_parser("generate", help="generate from prompts offline and print the answers",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("prompts", nargs="+", help="prompt(s); chat-formatted unless --raw")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    add_engine_args(gen, model_positional=False)

    comp = sub.add_parser("compile", help="compile every bucket into the compile cache, then exit",
                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(comp)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bserve = bsub.add_parser("serve", help="serving benchmark against an OpenAI-compatible server",
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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

            bench_main(args)
            return 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
