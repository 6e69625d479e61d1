"""`vllm-neuron buckets advise`: bucket lists for the traffic an engine served (config/bucket_advisor.py), from
its summary file, its DEBUG log or its /metrics (entrypoints/cli/bucket_sources.py): the lists, their padding
and compile time against the current ones, and the --additional-config JSON to start with."""
from __future__ import annotations

import argparse
import json

from vllm_neuron.config import buckets as B
from vllm_neuron.config.arg_utils import HelpFormatter
from vllm_neuron.config.bucket_advisor import Advice, Limits, Lists, advise, validate_lists
from vllm_neuron.entrypoints.cli import bucket_sources as S


def add_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="buckets_command", required=True)
    p = sub.add_parser("advise", help="bucket lists that minimise padding for the traffic an engine served",
                       description="Propose num_batched_tokens_buckets, num_seqs_buckets and "
                       "decode_context_length_buckets minimising the expected padding (prefill cost ~ bucket tokens, "
                       "decode cost ~ batch bucket x context bucket) under a graph budget, from what an engine "
                       "served. Exactly one source.", usage="vllm-neuron buckets advise (--from URL | --from-log FILE "
                       "| --from-summary FILE) [--max-graphs N]", formatter_class=HelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="from_url", metavar="METRICS_URL",
                     help="a running server (http://host:port or its /metrics URL): the step-shape histograms "
                     "(default: none; one source is required)")
    src.add_argument("--from-log", metavar="FILE",
                     help="an engine log written with VLLM_NEURON_LOG_LEVEL=DEBUG: its per-step lines (exact) "
                     "(default: none; one source is required)")
    src.add_argument("--from-summary", metavar="FILE",
                     help="the engine's served_shapes.json, in its compile cache folder (default: none; one source "
                     "is required)")
    p.add_argument("--max-graphs", type=int, default=None,
                   help="graph budget, prefill and decode (and verification) graphs together (default: as many as "
                   "the current lists make)")
    for flag, what in (("--max-num-batched-tokens", "the largest prefill bucket"),
                       ("--max-num-seqs", "the largest decode batch bucket"),
                       ("--max-model-len", "the largest context bucket"),
                       ("--block-size", "context buckets are multiples of lcm(128, block size)")):
        p.add_argument(flag, type=int, default=None,
                       help=f"the engine's {flag[2:].replace('-', '_')}: {what} (default: what the source says)")


def _source(args: argparse.Namespace) -> S.Source:
    if args.from_summary:
        src = S.from_summary(args.from_summary)
    elif args.from_log:
        src = S.from_log(args.from_log)
    else:
        src = S.from_metrics(args.from_url)
    return S.with_overrides(src, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                            max_model_len=args.max_model_len, block_size=args.block_size)


def _default_lists(limits: Limits) -> Lists:
    return Lists(tuple(B.default_prefill_buckets(limits.max_num_batched_tokens)),
                 tuple(B.default_decode_buckets(limits.max_num_seqs)), (limits.max_model_len,))


def _compile_estimate(lists: Lists, limits: Limits, per_graph: dict[str, float]) -> str:
    p_graphs = len(lists.prefill) * limits.prefill_graphs_per_bucket
    d_graphs = lists.graphs(limits) - p_graphs
    if "prefill" not in per_graph or (d_graphs and "decode" not in per_graph):
        return "unknown (no compile times recorded)"
    seconds = p_graphs * per_graph["prefill"] + d_graphs * per_graph.get("decode", 0.0)
    return f"~{seconds:.0f} s"


def _fmt(values) -> str:
    return ", ".join(str(v) for v in values)


def report(advice: Advice, src: S.Source, assumed_lists: bool) -> str:
    limits = src.limits
    t = src.traffic
    cur, new = advice.current, advice.proposed
    rows = [("", "current" + (" (assumed: the defaults)" if assumed_lists else ""), "advised"),
            ("num_batched_tokens_buckets", _fmt(cur.prefill), _fmt(new.prefill)),
            ("num_seqs_buckets", _fmt(cur.decode), _fmt(new.decode)),
            ("decode contexts (+ max_model_len)", _fmt(cur.contexts), _fmt(new.contexts)),
            ("graphs", str(advice.before.graphs), f"{advice.after.graphs} (budget {advice.budget})"),
            ("prefill padding (of its compute)", f"{advice.before.prefill_padding:.1%}",
             f"{advice.after.prefill_padding:.1%}"),
            ("decode padding (of its compute)", f"{advice.before.decode_padding:.1%}",
             f"{advice.after.decode_padding:.1%}"),
            ("expected busy time", f"{advice.before.expected_time:.2f}", f"{advice.after.expected_time:.2f}"),
            ("compile time (estimate)", _compile_estimate(cur, limits, src.compile_seconds),
             _compile_estimate(new, limits, src.compile_seconds))]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"Bucket advice from the {src.what}: {t.steps:.0f} steps ({sum(t.prefill.values()):.0f} prefill, "
             f"{sum(t.decode.values()):.0f} decode); limits max_num_batched_tokens={limits.max_num_batched_tokens} "
             f"max_num_seqs={limits.max_num_seqs} max_model_len={limits.max_model_len} block_size={limits.block_size}"]
    lines += [f"  {a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    lines.append("Expected busy time: 1.00 = the current lists; each kind's time taken as proportional to its "
                 "padded compute" + (", weighted by its measured share" if t.seconds else ", both kinds equal"))
    lines.append("Merge into your neuron_config:")
    lines.append("--additional-config '" + json.dumps({"neuron_config": new.neuron_config()}) + "'")
    return "\n".join(lines)


def run_buckets(args: argparse.Namespace) -> int:
    """`buckets advise`; ValueError (exit 2 with its message) on empty or malformed data."""
    src = _source(args)
    assumed = src.current is None
    current = src.current or _default_lists(src.limits)
    advice = advise(src.traffic, src.limits, current, args.max_graphs)
    validate_lists(advice.proposed, src.limits)
    print(report(advice, src, assumed))
    return 0
