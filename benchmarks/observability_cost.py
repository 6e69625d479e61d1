"""Issue 53's two measurements, each on `vllm-neuron serve` loaded by `vllm-neuron bench serve`.

    python benchmarks/observability_cost.py overhead [--rounds 3] [--model M] [--ours-args "..."]
    python benchmarks/observability_cost.py advisor [--num-prompts 200] [--model M] [--ours-args "..."]

overhead: P1 (64 requests x 256 random prompt tokens -> 128 output tokens, 16 at a time) against a server with
  the always-on step timing (VLLM_NEURON_STEP_TIMING=1) and one without it (=0), in alternating rounds (a new
  server per arm and round, so drift on a shared machine lands on both arms); output tok/s per run, the
  medians and their difference.
advisor: a ShareGPT-like length mix (synthetic: the prompt and answer words drawn from log-normal laws shaped like
  ShareGPT's, written as a ShareGPT json and sent through bench serve's sharegpt dataset) against the default
  buckets, then `vllm-neuron buckets advise --from-summary` on what that server served, then the same requests
  against a server with the advised lists: throughput of each, the advisor's table (compute-weighted padding of
  both lists on the served shapes, contexts included), and the fill-ratio padding /metrics shows for each run.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers.servers import RunningServer, ServerSpec, warm_up  # noqa: E402

_WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
          "government company number group problem fact").split()


def _serve_spec(model: str | None, extra: list[str], env: dict[str, str]) -> ServerSpec:
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-neuron")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "vllm_neuron.entrypoints.cli.main"]
    return ServerSpec(cmd + ["serve", *([model] if model else []), "--host", "127.0.0.1", "--port", "{port}",
                             *extra], env)


def _bench(url: str, argv: list[str]) -> dict:
    from vllm_neuron.benchmarks import serve

    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    with contextlib.redirect_stdout(io.StringIO()):
        result = serve.main(parser.parse_args(["--base-url", url, "--disable-tqdm", *argv]))
    if result["failed"]:
        raise RuntimeError(f"{result['failed']} requests failed (log of the server: see --workdir)")
    return result


def _started(spec: ServerSpec, log: str, timeout_s: float = 1800.0) -> RunningServer:
    srv = RunningServer(spec, log)
    srv.wait_ready(timeout_s)
    warm_up(srv.base_url)
    return srv


def run_overhead(args: argparse.Namespace, workdir: Path) -> dict:
    p1 = ["--dataset-name", "random", "--num-prompts", str(args.num_prompts), "--random-input-len", "256",
          "--random-output-len", "128", "--max-concurrency", "16", "--tokenizer", args.tokenizer]
    runs: dict[str, list[float]] = {"on": [], "off": []}
    for rnd in range(args.rounds):
        for arm in (("on", "off") if rnd % 2 == 0 else ("off", "on")):
            env = {"VLLM_NEURON_STEP_TIMING": "1" if arm == "on" else "0"}
            srv = _started(_serve_spec(args.model, shlex.split(args.ours_args), env),
                           str(workdir / f"overhead-{arm}-{rnd}.log"))
            try:
                r = _bench(srv.base_url, [*p1, "--seed", str(rnd)])
            finally:
                srv.stop()
            runs[arm].append(r["output_throughput"])
            print(f"round {rnd + 1} step timing {arm}: {r['output_throughput']:.1f} output tok/s", flush=True)
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    print(f"P1 median output tok/s: step timing on {on:.1f}, off {off:.1f}: {100 * (on - off) / off:+.1f}% "
          f"(runs on {runs['on']}, off {runs['off']})")
    return {"runs": runs, "median_on": on, "median_off": off}


def sharegpt_like(path: Path, n: int, seed: int, max_words: int) -> None:
    """A ShareGPT-format json whose first human / gpt turns have ShareGPT-like word counts (log-normal: prompts
    median ~60 words with a long tail, answers median ~150 words)."""
    rng = random.Random(seed)

    def words(mu: float, sigma: float) -> str:
        k = max(1, min(max_words, int(math.exp(rng.gauss(mu, sigma)))))
        return " ".join(rng.choice(_WORDS) for _ in range(k))

    path.write_text(json.dumps([{"id": str(i), "conversations": [
        {"from": "human", "value": words(4.1, 1.1)}, {"from": "gpt", "value": words(5.0, 0.8)}]}
        for i in range(n)]))


def _padding(url: str) -> dict[str, float]:
    """Compute-weighted padding per step kind from /metrics: 1 - sum(fill x bucket size) / sum(bucket size)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from vllm_neuron.config.buckets import parse_bucket_name

    sums: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        if fam.name != "vllm_neuron:bucket_fill_ratio":
            continue
        for s in fam.samples:
            if s.name.endswith(("_sum", "_count")):
                sums.setdefault(s.labels["bucket_name"], {})[s.name.rsplit("_", 1)[1]] = s.value
    real = {"prefill": 0.0, "decode": 0.0}
    cost = {"prefill": 0.0, "decode": 0.0}
    for name, v in sums.items():
        kind, size, ctx = parse_bucket_name(name)
        kind = "prefill" if kind == "prefill" else "decode"
        weight = size * (ctx or 1)  # a decode step's cost ~ batch x context bucket
        real[kind] += v.get("sum", 0.0) * weight
        cost[kind] += v.get("count", 0.0) * weight
    return {k: 1 - real[k] / cost[k] if cost[k] else 0.0 for k in real}


def run_advisor(args: argparse.Namespace, workdir: Path) -> dict:
    data = workdir / "sharegpt_like.json"
    sharegpt_like(data, args.num_prompts, 0, args.max_words)
    load = ["--dataset-name", "sharegpt", "--dataset-path", str(data), "--num-prompts", str(args.num_prompts),
            "--max-concurrency", "16", "--tokenizer", args.tokenizer, "--seed", "0"]
    cache = workdir / "cache"  # a compile cache of this run's own: its served_shapes.json is this workload's
    env = {"NEURON_COMPILED_ARTIFACTS": str(cache)}
    out: dict = {}
    for arm, extra in (("default", []), ("advised", None)):
        if extra is None:
            summary = next(cache.rglob("served_shapes.json"))
            buf = io.StringIO()
            from vllm_neuron.entrypoints.cli.main import main as cli

            with contextlib.redirect_stdout(buf):
                rc = cli(["buckets", "advise", "--from-summary", str(summary)])
            print(buf.getvalue())
            if rc:
                raise RuntimeError(f"buckets advise exited {rc}")
            advised = buf.getvalue().split("--additional-config '")[1].strip().rstrip("'")
            out["advised_config"] = json.loads(advised)
            extra = ["--additional-config", advised]
        srv = _started(_serve_spec(args.model, shlex.split(args.ours_args) + extra, env),
                       str(workdir / f"advisor-{arm}.log"))
        try:
            r = _bench(srv.base_url, load)
            pad = _padding(srv.base_url)
            time.sleep(2.0)  # the engine writes served_shapes.json once idle; stop() signals its whole group
        finally:
            srv.stop()
        out[arm] = {"output_tok_s": r["output_throughput"], "mean_ttft_ms": r["mean_ttft_ms"],
                    "median_tpot_ms": r["median_tpot_ms"], "padding": pad}
        print(f"{arm} buckets: {r['output_throughput']:.1f} output tok/s, mean TTFT {r['mean_ttft_ms']:.0f} ms, "
              f"median TPOT {r['median_tpot_ms']:.1f} ms; fill-ratio padding (/metrics: tokens, sequences; "
              f"contexts not counted) prefill {pad['prefill']:.1%}, decode {pad['decode']:.1%}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("what", choices=("overhead", "advisor"))
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: the bundled model)")
    p.add_argument("--tokenizer", default=None, help="for the bench client (default: --model, else the bundled one)")
    p.add_argument("--ours-args", default="", help="extra `vllm-neuron serve` flags, one string")
    p.add_argument("--rounds", type=int, default=3, help="overhead: rounds of (on, off)")
    p.add_argument("--num-prompts", type=int, default=None, help="default: 64 (overhead, P1), 200 (advisor)")
    p.add_argument("--max-words", type=int, default=1500, help="advisor: longest prompt / answer in words")
    p.add_argument("--workdir", default=None, help="logs, dataset, compile cache (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.tokenizer is None:
        from vllm_neuron.model.loader import bundled_model_path

        args.tokenizer = args.model or bundled_model_path()
    args.num_prompts = args.num_prompts or (64 if args.what == "overhead" else 200)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="obs_cost_"))
    workdir.mkdir(parents=True, exist_ok=True)
    result = run_overhead(args, workdir) if args.what == "overhead" else run_advisor(args, workdir)
    (workdir / f"{args.what}.json").write_text(json.dumps(result, indent=1))
    print(f"results and logs: {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
