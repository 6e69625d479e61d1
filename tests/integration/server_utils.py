"""Running the real `vllm-neuron` command in a subprocess: the CLI prefix, a server process with
its log, and a poll helper. Used by the end-to-end server, CLI and compile-cache tests.

Every child gets its own PROMETHEUS_MULTIPROC_DIR: the variable is inherited, and two servers
writing to one folder would add up each other's metrics.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SCRIPT = os.path.join(os.path.dirname(sys.executable), "vllm-neuron")


def cli() -> list[str]:
    """The `vllm-neuron` console script when installed, else `python -m` of its module."""
    if os.path.isfile(_SCRIPT) and os.access(_SCRIPT, os.X_OK):
        return [_SCRIPT]
    return [sys.executable, "-m", "vllm_neuron.entrypoints.cli.main"]


def child_env(tmp_dir: str, **extra: str) -> dict[str, str]:
    """The test process' environment for a child, with a private metrics folder and CPU only."""
    env = dict(os.environ)
    env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="prom_", dir=tmp_dir)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = _REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_cli(args: list[str], tmp_dir: str, timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Runs `vllm-neuron ARGS` to completion; stdout and stderr are captured as text. On timeout
    the whole process group goes (a `serve` leaves an EngineCore grandchild) and TimeoutExpired
    is raised."""
    proc = subprocess.Popen(cli() + args, cwd=_REPO, env=child_env(tmp_dir, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, out, err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.1, what: str = "condition") -> Any:
    """Polls until `predicate()` is truthy and returns it; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


class ServerProcess:
    """`vllm-neuron serve MODEL ARGS` on a free port, logging to a file."""

    def __init__(self, model: str, args: list[str], tmp_dir: str, **env: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp_dir, f"server-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.env = child_env(tmp_dir, **env)
        # A session of its own, so that kill() can take the EngineCore grandchild along.
        self.proc = subprocess.Popen(cli() + ["serve", model, "--port", str(self.port), *args], cwd=_REPO,
                                     env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode} before it was healthy:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"server not healthy after {timeout} s:\n{self.log()}")

    def children(self) -> list[int]:
        out: list[int] = []
        try:
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                with open(f"/proc/{self.proc.pid}/task/{tid}/children") as f:
                    out.extend(int(p) for p in f.read().split())
        except OSError:  # the server is gone
            pass
        return out

    def children_running(self, marker: bytes) -> list[int]:
        """The children whose command line contains `marker`."""
        found = []
        for pid in self.children():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as c:
                    if marker in c.read():
                        found.append(pid)
            except OSError:
                continue
        return found

    def child_running(self, marker: bytes) -> int | None:
        """The first child whose command line contains `marker`, or None."""
        found = self.children_running(marker)
        return found[0] if found else None

    def engine_pid(self) -> int:
        """The EngineCore child: the spawned multiprocessing child (the other one is the
        resource tracker)."""
        pid = self.child_running(b"spawn_main")
        if pid is None:
            raise AssertionError(f"no EngineCore child of server pid {self.proc.pid}")
        return pid

    def stop(self, timeout: float = 15.0) -> tuple[int | None, float]:
        """SIGTERM, then waits; returns (exit code or None when it had to be killed, seconds)."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code: int | None = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = None
            self.dump_stacks()  # what the stuck process waits on, into the log the caller reports
            self.kill()
        return code, time.monotonic() - t0

    def dump_stacks(self, settle: float = 1.0) -> None:
        """SIGUSR1 to the server and its EngineCores, one at a time (they share the log: dumps at once interleave):
        each prints its threads' stacks into the log (proc_lifecycle). Not to its other children (the resource
        tracker, the grammar compiler): SIGUSR1 would end them."""
        for pid in [self.proc.pid, *self.children_running(b"spawn_main")]:
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                continue
            time.sleep(settle)

    def kill(self) -> None:
        """SIGKILL to the server's process group (an orphaned EngineCore would idle forever)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except OSError:  # the group is gone already
            pass
        self.proc.wait(10)
        if not self._log.closed:
            self._log.close()


@contextmanager
def serving(model: str, args: list[str], tmp_dir: str, timeout: float = 120.0, **env: str) -> Iterator[ServerProcess]:
    """A healthy `ServerProcess`, stopped (and its process group killed) afterwards."""
    srv = ServerProcess(model, args, tmp_dir, **env)
    try:
        srv.wait_healthy(timeout=timeout)
        yield srv
    finally:
        srv.stop()
        srv.kill()


@contextmanager
def two_loopback_nodes(model: str, args: list[str], tmp_path, **env: str) -> Iterator[tuple[ServerProcess, subprocess.Popen]]:
    """`serve` over two "nodes" on loopback: (the head, node 0 with the API server, started; node 1, a
    `--headless` process tree logging to tmp_path / "node1.log"), both killed afterwards. The caller waits
    for the head to be healthy."""
    nodes = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    head = ServerProcess(model, args + nodes + ["--node-rank", "0"], str(tmp_path), **env)
    follower_log = open(tmp_path / "node1.log", "w")
    follower = subprocess.Popen(cli() + ["serve", model, *args, *nodes, "--node-rank", "1", "--headless"],
                                env=child_env(str(tmp_path), **env), stdout=follower_log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield head, follower
    finally:
        head.kill()
        if follower.poll() is None:
            os.killpg(follower.pid, signal.SIGKILL)
            follower.wait(10)
        follower_log.close()


def rank_children(pid: int) -> list[int]:
    """The tensor-parallel rank processes `pid` started."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                for child in f.read().split():
                    with open(f"/proc/{child}/cmdline", "rb") as c:
                        if b"vllm_neuron.worker.tp_executor" in c.read():
                            out.append(int(child))
    except OSError:
        pass
    return out
