"""`vllm-neuron`: serve | generate | compile | validate-logits | profile | buckets advise | disagg-proxy | epd-proxy |
bench serve."""
from __future__ import annotations

import argparse
import difflib
import sys

from vllm_neuron.config.arg_utils import HelpFormatter, add_engine_args, arg_group
from vllm_neuron.config.engine_args import BUNDLED_MODEL_NAME


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """`serve`'s own flags (HTTP listener, served names, logging)."""
    from vllm_neuron.entrypoints.openai.request_policy import (DEFAULT_BODY_READ_TIMEOUT_S, DEFAULT_MAX_N,
                                                               DEFAULT_MAX_REQUEST_BODY_BYTES)
    from vllm_neuron.reasoning import ReasoningParserManager
    from vllm_neuron.tool_parsers import ToolParserManager

    g = arg_group(parser, "server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes "
                   "(default: $VLLM_API_KEY, else no key)")
    g.add_argument("--api-key-all-routes", action="store_true",
                   help="require the API key on every route but the liveness probes (/health, /ping, /version) and "
                   "the web UI's pages: "
                   "/metrics, /tokenize, /detokenize, /openapi.json and the docs too (without it, as in vLLM, only "
                   "/v1 routes need it)")
    g.add_argument("--ssl-keyfile", default=None,
                   help="serve HTTPS: the server's PEM private key (default: plain HTTP)")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the server's PEM certificate (chain) (default: "
                   "plain HTTP)")
    g.add_argument("--ssl-ca-certs", default=None, help="PEM CA certificates that client certificates must chain to "
                   "(with --ssl-cert-reqs 1 or 2) (default: none)")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                   help="client certificates: 0 not asked for, 1 checked when given, 2 required (Python's ssl.CERT_*)")
    g.add_argument("--root-path", default=None,
                   help="path prefix a proxy serves the API under, e.g. /llm: routes answer with and without it, "
                   "/openapi.json and the docs point through it (default: none)")
    g.add_argument("--allowed-origins", nargs="+", default=None,
                   help="CORS origins, as words or vLLM's JSON list (default: any)")
    g.add_argument("--allowed-methods", nargs="+", default=None,
                   help="CORS methods, as words or vLLM's JSON list (default: any)")
    g.add_argument("--allowed-headers", nargs="+", default=None,
                   help="CORS request headers, as words or vLLM's JSON list (default: any)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth headers)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="vLLM's flag, accepted: X-Request-Id is honoured and echoed whether it is given or not "
                   "(default: echoed)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request's id, prompt (see --max-log-len), token ids, sampling parameters and "
                   "priority as it goes to the engine")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="characters of prompt / output and token ids a request log line shows (default: all)")
    g.add_argument("--enable-log-outputs", action="store_true",
                   help="with --enable-log-requests, also log each answer (text, token ids, finish reason)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="turn off uvicorn's access log (one line per HTTP request; on by default, as in vLLM)")
    g.add_argument("--disable-webui", action="store_true",
                   help="leave out the web UI: the chat page at / and the metrics dashboard at /dashboard (on by "
                   "default; llama-server's --no-webui)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="turn off the engine stats logged every 10 s (throughput, requests, KV usage, "
                   "prefix-cache hit rate)")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="larger request bodies get a 413 before they are read")
    g.add_argument("--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT_S,
                   help="seconds in which a request body must arrive whole; a slower (or shorter than its "
                   "Content-Length) body gets a 408 and the connection is closed")
    g = arg_group(parser, "frontend")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a `chat_template` sent in a request (it runs on the server; refused otherwise)")
    g.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                   help="largest `n` (completions per request) a request may ask for; larger gets a 400")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) the API reports and accepts (default: MODEL as given, else "
                   f"{BUNDLED_MODEL_NAME})")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice="auto" (needs --tool-call-parser)')
    g.add_argument("--tool-call-parser", default=None, choices=ToolParserManager.names(),
                   help="how tool calls are read from the model's answer when tool_choice is auto (default: none)")
    g.add_argument("--reasoning-parser", default=None, choices=ReasoningParserManager.names(),
                   help="split the model's reasoning from its answer: `reasoning_content` / `reasoning` in chat "
                   "answers, structured outputs after the reasoning; openai_gptoss: harmony for gpt-oss (default: "
                   "none, the answer as the model wrote it)")
    g.add_argument("--enable-store", action="store_true",
                   help="/v1/responses keeps its answers in memory for previous_response_id and GET "
                   "/v1/responses/{id} (or VLLM_ENABLE_RESPONSES_API_STORE=1); off: nothing is kept")
    g.add_argument("--responses-store-size", type=int, default=1000,
                   help="with --enable-store, the most responses kept (the oldest go first)")
    g = arg_group(parser, "parallel")
    g.add_argument("--headless", action="store_true",
                   help="no API server: run this node's data parallel replicas (--data-parallel-size-local of them, "
                   "from --data-parallel-start-rank) for the head at --data-parallel-address, or, with --nnodes > 1, "
                   "this node's tensor parallel ranks (--node-rank >= 1) for the head at --master-addr")



def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-neuron", description="vLLM Neuron's design on PyTorch devices")
    sub = p.add_subparsers(dest="command", required=True)

    # Short usage lines: argparse's own lists every one of ~100 flags before the error it explains.
    serve = sub.add_parser("serve", help="OpenAI-compatible server (default: the bundled SmolLM2-135M-Instruct)",
                           description="Serve a model over vLLM's OpenAI-compatible HTTP API.",
                           usage="vllm-neuron serve [MODEL] [options]", formatter_class=HelpFormatter)
    add_engine_args(serve)
    add_server_args(serve)

    gen = sub.add_parser("generate", help="generate from prompts offline and print the answers",
                         description="Load the model in this process, answer the prompts, print the answers. "
                         "Sampling defaults come from the model's generation config (see --generation-config). "
                         "The answers go to stdout, the log to stderr (warnings only, unless -v).",
                         usage="vllm-neuron generate [options] PROMPT [PROMPT ...]", formatter_class=HelpFormatter)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt(s); chat-formatted unless --raw")
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    gen.add_argument("-v", "--verbose", action="store_true",
                     help="log the engine's start-up and progress to stderr, as serve does")
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
                          "the same flags loads every graph without compiling.",
                          usage="vllm-neuron compile [MODEL] [options]", formatter_class=HelpFormatter)
    add_engine_args(comp)

    val = sub.add_parser("validate-logits", help="compare the engine's log-probabilities with transformers fp32 / bf16",
                         description="Teacher-forced logit validation against transformers (fp32 and bf16) on the "
                         "same prompts, text or with images / videos: per position the largest difference of the "
                         "top-k log-probabilities and the top-k overlap.",
                         usage="vllm-neuron validate-logits [MODEL] [options]", formatter_class=HelpFormatter)
    from vllm_neuron.entrypoints.cli.validate_logits import add_args as add_validate_args

    add_validate_args(val)
    add_engine_args(val)

    prof = sub.add_parser("profile", help="profile a workload offline: per bucket graph time vs host time, top ops, "
                          "bubbles between steps", description="Run a short workload on the model in this process "
                          "under torch.profiler (VLLM_TORCH_PROFILER_DIR) and print, per bucket, the graph time "
                          "against the host time of its steps, the ops inside its graph, and the gaps between graph "
                          "executions; the traces stay for Perfetto.",
                          usage="vllm-neuron profile [MODEL] [options]", formatter_class=HelpFormatter)
    from vllm_neuron.entrypoints.cli.profile import add_args as add_profile_args

    add_profile_args(prof)
    add_engine_args(prof)

    bk = sub.add_parser("buckets", help="bucket lists for the traffic an engine served (buckets advise)",
                        usage="vllm-neuron buckets advise [options]")
    from vllm_neuron.entrypoints.cli.buckets import add_args as add_buckets_args

    add_buckets_args(bk)

    proxy = sub.add_parser("disagg-proxy", help="one OpenAI endpoint in front of prefill and decode instances "
                           "(disaggregated prefill/decode; instances started with --kv-transfer-config)",
                           usage="vllm-neuron disagg-proxy --prefill URL [URL ...] --decode URL [URL ...] [--port N]",
                           formatter_class=HelpFormatter)
    proxy.add_argument("--prefill", nargs="+", required=True, metavar="URL", default=argparse.SUPPRESS,
                       help="prefill instances (kv_role kv_producer or kv_both), e.g. http://127.0.0.1:8100 (default: none; "
                       "required)")
    proxy.add_argument("--decode", nargs="+", required=True, metavar="URL", default=argparse.SUPPRESS,
                       help="decode instances (kv_role kv_consumer or kv_both) (default: none; required)")
    proxy.add_argument("--host", default="127.0.0.1", help="address to listen on")
    proxy.add_argument("--port", type=int, default=8000, help="port to listen on")
    proxy.add_argument("--timeout", type=float, default=600.0, help="seconds an instance may take to answer")

    epd = sub.add_parser("epd-proxy", help="one OpenAI endpoint in front of EPD encoder instances "
                         "(--mm-encoder-only) and prefill+decode instances (an ec_consumer)",
                         usage="vllm-neuron epd-proxy --encode URL [URL ...] --pd URL [URL ...] [--port N]",
                         formatter_class=HelpFormatter)
    epd.add_argument("--encode", nargs="+", required=True, metavar="URL", default=argparse.SUPPRESS,
                     help="encoder instances, e.g. http://127.0.0.1:8200 (default: none; required)")
    epd.add_argument("--pd", nargs="+", required=True, metavar="URL", default=argparse.SUPPRESS,
                     help="prefill+decode instances (default: none; required)")
    epd.add_argument("--host", default="127.0.0.1", help="address to listen on")
    epd.add_argument("--port", type=int, default=8000, help="port to listen on")
    epd.add_argument("--timeout", type=float, default=600.0, help="seconds a prefill+decode instance may take")
    epd.add_argument("--encode-timeout", type=float, default=60.0,
                     help="seconds an encoder instance may take for one media item before the next is tried")
    epd.add_argument("--encode-attempts", type=int, default=3,
                     help="encoder instances tried per media item before the prefill+decode instance is left to it")

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bserve = bsub.add_parser("serve", help="serving benchmark against an OpenAI-compatible server",
                             usage="vllm-neuron bench serve [options]", formatter_class=HelpFormatter)
    from vllm_neuron.benchmarks.serve import add_cli_args

    add_cli_args(bserve)
    return p


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser that parsed `args` (`vllm-neuron bench serve`'s for bench serve)."""
    for dest in ("command", "bench_command", "buckets_command"):
        action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if action is None:
            break
        if getattr(args, dest, None) is None:
            continue
        parser = action.choices[getattr(args, dest)]
    return parser


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """argparse's message, with the nearest flag of this command for each unknown one."""
    flags = [f for a in parser._actions for f in a.option_strings if f.startswith("--")]
    hints = []
    for arg in extra:
        if arg.startswith("--"):
            near = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.75)
            if near:
                hints.append(f"did you mean {near[0]}?")
    message = f"unrecognized arguments: {' '.join(extra)}"
    return f"{message} ({'; '.join(hints)})" if hints else message


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would report them with the top-level usage: the command's, and a suggestion, instead
        command = _command_parser(parser, args)
        command.error(_unrecognized(command, extra))
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
        if args.command == "validate-logits":
            from vllm_neuron.entrypoints.cli.validate_logits import run_validate_logits

            return run_validate_logits(args)
        if args.command == "profile":
            from vllm_neuron.entrypoints.cli.profile import run_profile

            return run_profile(args)
        if args.command == "buckets":
            from vllm_neuron.entrypoints.cli.buckets import run_buckets

            return run_buckets(args)
        if args.command == "disagg-proxy":
            from vllm_neuron.entrypoints.disagg.proxy import run_proxy

            return run_proxy(args)
        if args.command == "epd-proxy":
            from vllm_neuron.entrypoints.epd.proxy import run_epd_proxy

            return run_epd_proxy(args)
        if args.command == "bench":
            from vllm_neuron.benchmarks.serve import main as bench_main

            result = bench_main(args)
            return 130 if result.get("interrupted") else 0  # 130: Ctrl-C, after the partial table
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was interrupted has logged its line (a download: what it kept)
        print("interrupted", file=sys.stderr)
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
