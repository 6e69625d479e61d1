"""The API server process's CPU share while the engine serves P1 (issue 17 item 5), in one run.

Starts `vllm-neuron serve` (the bundled model by default), warms it up, then runs `vllm-neuron bench serve`
with P1 (64 requests x 256 random prompt tokens, 128 output tokens, 16 concurrent; `--num-prompts 8
--max-concurrency 1` makes it P2) in a process of its own, and reads every process's CPU time
(/proc/<pid>/stat utime + stime) before and after: the API server
(HTTP, tokenization, detokenization, SSE; its threads listed apart), the EngineCore process(es) it
spawned, the benchmark client, and the whole machine (/proc/stat) - whatever else runs on it. Prints each
one's CPU seconds, share of the wall time (1.0 = one core busy all the time) and share of the cores.

    python benchmarks/api_cpu_share.py [--server-args='--enforce-eager'] [--num-prompts 64] [--max-concurrency 16]
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from peers.servers import RunningServer, ServerSpec, warm_up  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> list[str]:
    """The fields after the `(comm)` of a /proc stat file (comm may hold spaces)."""
    with open(path) as f:
        text = f.read()
    return text[text.rindex(")") + 2:].split()


def cpu_seconds(pid: int, tid: int | None = None) -> float:
    """utime + stime of a process (every thread) or one of its threads, in seconds."""
    fields = _stat_fields(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of proc(5), counted from 1


def thread_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds) of every live thread of a process."""
    out = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                out[tid] = (f.read().strip(), cpu_seconds(pid, tid))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot (/proc/stat's cpu line)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    return (sum(vals[:8]) - idle) / _TICK, sum(vals[:8]) / _TICK


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent[int(entry)] = int(_stat_fields(f"/proc/{entry}/stat")[1])
            except (FileNotFoundError, ProcessLookupError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def role(pid: int) -> str:
    """What a process below the server is: an EngineCore (a multiprocessing spawn child), or its command."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    if "resource_tracker" in cmd:
        return "multiprocessing resource tracker"
    if "multiprocessing.spawn" in cmd or "spawn_main" in cmd:
        return "EngineCore"
    return cmd[:60]


@dataclass
class Share:
    name: str
    seconds: float

    def row(self, wall: float, cores: int) -> str:
        return f"| {self.name} | {self.seconds:.1f} | {self.seconds / wall:.3f} | {100 * self.seconds / wall / cores:.1f}% |"


def _exe() -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "vllm-neuron")
    return [exe] if os.path.exists(exe) else [sys.executable, "-m", "vllm_neuron.entrypoints.cli.main"]


def measure(args: argparse.Namespace) -> list[Share]:
    from vllm_neuron.model.loader import bundled_model_path

    model = os.path.abspath(args.model or bundled_model_path())
    log = os.path.join(args.log_dir, "api_cpu_share-server.log")
    server = RunningServer(ServerSpec(_exe() + ["serve", model, "--host", "127.0.0.1", "--port", "{port}",
                                               *shlex.split(args.server_args)]), log)
    try:
        print(f"server starting (log: {log}) ...", flush=True)
        print(f"ready after {server.wait_ready(args.ready_timeout):.0f} s", flush=True)
        warm_up(server.base_url)
        api = server.proc.pid
        engines = {p: role(p) for p in descendants(api)}
        print("processes: API server " + str(api) + "; " + ", ".join(f"{r} {p}" for p, r in engines.items()),
              flush=True)
        bench = _exe() + ["bench", "serve", "--base-url", server.base_url, "--dataset-name", "random",
                          "--num-prompts", str(args.num_prompts), "--random-input-len", "256",
                          "--random-output-len", "128", "--max-concurrency", str(args.max_concurrency), "--seed", "0",
                          "--tokenizer", model, "--disable-tqdm"]
        before = {p: cpu_seconds(p) for p in [api, *engines]}
        threads_before = thread_seconds(api)
        m0 = machine_busy_seconds()
        t0 = time.perf_counter()
        client = subprocess.run(bench, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        # The client's own CPU time: what its (waited-for) process used, from the children's rusage.
        client_s = sum(os.times()[2:4])
        m1 = machine_busy_seconds()
        after = {p: cpu_seconds(p) for p in [api, *engines]}
        threads_after = thread_seconds(api)
    finally:
        server.stop()
    if client.returncode != 0:
        raise RuntimeError(f"bench serve failed ({client.returncode}): {client.stderr[-2000:]}")
    summary = [line for line in client.stdout.splitlines() if "throughput" in line.lower() or "TPOT" in line]
    print("\n".join(summary))
    # The shares' window is the benchmark's own duration (the client's start-up, before it, is left out).
    wall = _figure(client.stdout, "Benchmark duration (s):") or wall
    tokens = _figure(client.stdout, "Total generated tokens:")
    cores = len(os.sched_getaffinity(0))
    shares = [Share("API server (all threads)", after[api] - before[api])]
    by_thread: dict[str, float] = {}
    for tid, (name, s) in threads_after.items():
        label = "main thread (event loop)" if tid == api else f"thread '{name}'"
        by_thread[label] = by_thread.get(label, 0.0) + s - threads_before.get(tid, (name, 0.0))[1]
    shares += [Share(f"  {label}", s) for label, s in sorted(by_thread.items(), key=lambda kv: -kv[1]) if s > 0]
    shares += [Share(f"{r} (pid {p})", after[p] - before[p]) for p, r in engines.items()]
    shares += [Share("bench serve client (start-up included)", client_s), Share("whole machine (every process)", m1[0] - m0[0])]
    print(f"\n{args.num_prompts} x 256 -> 128, {args.max_concurrency} concurrent took {wall:.1f} s wall on "
          f"{cores} cores; server args: {args.server_args or '(none)'}")
    print("| process | CPU seconds | share of wall (1.0 = one core) | share of the cores |")
    print("| --- | --- | --- | --- |")
    for s in shares:
        print(s.row(wall, cores))
    if tokens:
        # CPU time per token hardly depends on the machine's load, the shares of the wall do: this projects
        # the API server's share to any engine speed.
        per_token = shares[0].seconds / tokens * 1e3
        print(f"\nAPI server: {per_token:.2f} ms of CPU per output token ({tokens:.0f} tokens); at an engine speed "
              f"of T output tok/s it keeps {per_token:.2f} x T / 1000 of a core busy (e.g. "
              f"{per_token * 0.15:.2f} of a core at 150 tok/s)")
    return shares


def _figure(report: str, label: str) -> float | None:
    """A value of bench serve's result table."""
    return next((float(line.split(":")[1]) for line in report.splitlines() if line.startswith(label)), None)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="model path (default: the bundled model)")
    p.add_argument("--server-args", default="", help="extra `vllm-neuron serve` arguments")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16,
                   help="requests in flight (16 = P1; P2 is --num-prompts 8 --max-concurrency 1)")
    p.add_argument("--ready-timeout", type=float, default=1800.0)
    p.add_argument("--log-dir", default="/tmp")
    measure(p.parse_args(argv))


if __name__ == "__main__":
    main()
