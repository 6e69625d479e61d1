"""Disaggregated prefill/decode against one server, same run, on this machine's cores (issue 44).

    python benchmarks/disagg_vs_single.py [--input-len 1024] [--output-len 128] [--model PATH] [--eager]

Fair on a 2-core machine: a prefill instance pinned to core 0 and a decode instance pinned to core 1 (one thread
each) behind `vllm-neuron disagg-proxy`, against one server on both cores. Each runs `vllm-neuron bench serve`
twice with random prompts: P2 (8 requests one at a time: batch-1 latency) and 8 concurrent requests. Prints TTFT
and TPOT of each and the ratios, and from the decode instance's /metrics the KV bytes moved per request and the
mean transfer time as a share of the disaggregated TTFT.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx

VENV_BIN = os.path.dirname(sys.executable)
CLI = [os.path.join(VENV_BIN, "vllm-neuron")]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], cores: str, log: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(["taskset", "-c", cores, *CLI, *args], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def _wait(url: str, proc: subprocess.Popen, log: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited:\n{open(log).read()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout} s")


def _bench(url: str, concurrency: int, args, out_dir: str, label: str) -> dict:
    """8 random prompts, a different set per load (the same set twice would be served from the prefix cache),
    after one warm-up request of other tokens."""
    name = f"{label}-c{concurrency}.json"
    httpx.post(url + "/v1/completions", timeout=300, json={"prompt": "warm up " * 64, "max_tokens": 8})
    subprocess.run([*CLI, "bench", "serve", "--base-url", url, "--dataset-name", "random", "--random-input-len",
                    str(args.input_len), "--random-output-len", str(args.output_len), "--num-prompts", "8",
                    "--max-concurrency", str(concurrency), "--seed", str(100 + concurrency), "--disable-tqdm",
                    "--save-result", "--result-dir", out_dir, "--result-filename", name, "--num-warmups", "0"],
                   check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, name)) as f:
        return json.load(f)


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in "{ ")


def _stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, 15)
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--model", default=None, help="default: the bundled model")
    ap.add_argument("--eager", action="store_true", help="--enforce-eager on every server")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="disagg_bench_")
    model = [args.model] if args.model else []
    common = ["--disable-log-stats"] + (["--enforce-eager"] if args.eager else [])
    env = dict(os.environ)
    results: dict[str, dict] = {}

    # Disaggregated: P on core 0, D on core 1, the proxy wherever.
    pp, dp, xp = _port(), _port(), _port()
    kv = lambda role: json.dumps({"kv_connector": "TcpConnector", "kv_role": role, "kv_port": _port()})  # noqa: E731
    p = _start(["serve", *model, "--port", str(pp), *common, "--kv-transfer-config", kv("kv_producer")], "0",
               f"{tmp}/p.log", {**env, "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(dir=tmp)})
    d = _start(["serve", *model, "--port", str(dp), *common, "--kv-transfer-config", kv("kv_consumer")], "1",
               f"{tmp}/d.log", {**env, "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(dir=tmp)})
    try:
        _wait(f"http://127.0.0.1:{pp}", p, f"{tmp}/p.log")
        _wait(f"http://127.0.0.1:{dp}", d, f"{tmp}/d.log")
        x = _start(["disagg-proxy", "--prefill", f"http://127.0.0.1:{pp}", "--decode", f"http://127.0.0.1:{dp}",
                    "--port", str(xp)], "0-1", f"{tmp}/x.log", env)
        try:
            _wait(f"http://127.0.0.1:{xp}", x, f"{tmp}/x.log", 60)
            d_url = f"http://127.0.0.1:{dp}"
            for c in (1, 8):
                b0 = _metric(d_url, "vllm_neuron:kv_transfer_bytes_total")
                t0 = _metric(d_url, "vllm_neuron:kv_transfer_time_seconds_sum")
                n0 = _metric(d_url, "vllm_neuron:kv_transfer_time_seconds_count")
                r = _bench(f"http://127.0.0.1:{xp}", c, args, tmp, "disagg")
                n = _metric(d_url, "vllm_neuron:kv_transfer_time_seconds_count") - n0
                r["kv_bytes_per_req"] = (_metric(d_url, "vllm_neuron:kv_transfer_bytes_total") - b0) / max(n, 1)
                r["kv_seconds_per_req"] = (_metric(d_url, "vllm_neuron:kv_transfer_time_seconds_sum") - t0) / max(n, 1)
                r["recomputed"] = _metric(d_url, "vllm_neuron:kv_transfer_recomputed_total")
                results[f"disagg-c{c}"] = r
        finally:
            _stop(x)
    finally:
        _stop(p, d)

    sp = _port()
    s = _start(["serve", *model, "--port", str(sp), *common], "0-1", f"{tmp}/s.log",
               {**env, "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(dir=tmp)})
    try:
        _wait(f"http://127.0.0.1:{sp}", s, f"{tmp}/s.log")
        for c in (1, 8):
            results[f"single-c{c}"] = _bench(f"http://127.0.0.1:{sp}", c, args, tmp, "single")
    finally:
        _stop(s)

    print(f"\n{args.input_len} -> {args.output_len} tokens, 8 requests; disaggregated = P on core 0 + D on core 1 "
          "+ proxy; single = one server on both cores")
    print("| load | TTFT mean single | TTFT mean disagg | ratio | TPOT mean single | TPOT mean disagg | ratio "
          "| KV moved per request | transfer / disagg TTFT |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c, name in ((1, "P2 (one at a time)"), (8, "8 concurrent")):
        sg, dg = results[f"single-c{c}"], results[f"disagg-c{c}"]
        print(f"| {name} | {sg['mean_ttft_ms']:.0f} ms | {dg['mean_ttft_ms']:.0f} ms | "
              f"{dg['mean_ttft_ms'] / sg['mean_ttft_ms']:.2f} | {sg['mean_tpot_ms']:.1f} ms | {dg['mean_tpot_ms']:.1f} ms"
              f" | {dg['mean_tpot_ms'] / sg['mean_tpot_ms']:.2f} | {dg['kv_bytes_per_req'] / 2**20:.1f} MiB | "
              f"{dg['kv_seconds_per_req'] * 1000:.1f} ms = {100 * dg['kv_seconds_per_req'] * 1000 / dg['mean_ttft_ms']:.1f}% |")
    print(f"(requests the decode instance prefilled itself after a failed read: {results['disagg-c8']['recomputed']:.0f}; "
          f"logs in {tmp})")


if __name__ == "__main__":
    main()
