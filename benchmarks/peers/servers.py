"""Start one OpenAI-compatible server on a free port, wait until it serves, stop it.

Each server runs in its own process group so that stopping it also stops the workers it spawned
(vLLM's engine core); nothing else is ever signalled.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field

import httpx

from .install import tail


@dataclass
class ServerSpec:
    """How to start one engine's server: argv (with {port} filled in later) and extra env."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


class ServerStartError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """A started server process; `base_url` is valid once `wait_ready` returned."""

    def __init__(self, spec: ServerSpec, log_path: str) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.argv = [a.replace("{port}", str(self.port)) for a in spec.argv]
        env = dict(os.environ)
        env.update(spec.env)
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        self._log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 (closed by stop)
        self._log.write(f"$ {' '.join(self.argv)}\n")
        self._log.flush()
        try:
            self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True)
        except OSError as e:
            self._log.close()
            raise ServerStartError(f"cannot run {self.argv[0]}: {e}") from e

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until /health and /v1/models both answer 200; raise if it dies or times out."""
        t0 = time.perf_counter()
        deadline = t0 + timeout_s
        while time.perf_counter() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerStartError(f"exited {rc} before ready ({tail(self.log_path)}; "
                                       f"log: {self.log_path})")
            try:
                if (httpx.get(self.base_url + "/health", timeout=5).status_code == 200
                        and httpx.get(self.base_url + "/v1/models", timeout=5).status_code == 200):
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise ServerStartError(f"not ready after {timeout_s:.0f} s (log: {self.log_path})")

    def stop(self, grace_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Workers left behind by a leader that already exited still belong to its group.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log.close()


def warm_up(base_url: str, n: int = 2) -> None:
    """A few short completions so that one-off first-request costs stay out of the figures."""
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    for i in range(n):
        r = httpx.post(base_url + "/v1/completions", timeout=300,
                       json={"model": model, "prompt": f"Warm-up {i}: count to ten.",
                             "max_tokens": 8, "temperature": 0})
        r.raise_for_status()
