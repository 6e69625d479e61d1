"""The proxy's instances of one kind (prefill or decode): least outstanding requests first, failures counted,
an instance that failed skipped for a while (pure; no I/O)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Instance:
    url: str
    outstanding: int = 0
    requests: int = 0
    failures: int = 0
    down_until: float = 0.0  # skipped until then, unless every instance is down


class InstancePool:
    def __init__(self, kind: str, urls: list[str], *, backoff_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not urls:
            raise ValueError(f"the proxy needs at least one --{kind} URL")
        for u in urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"--{kind} {u!r} is not an http(s) URL (e.g. http://127.0.0.1:8100)")
        self.kind, self.backoff_s, self.clock = kind, backoff_s, clock
        self.instances = [Instance(u.rstrip("/")) for u in urls]

    def order(self) -> list[Instance]:
        """Every instance, best first: those up before those down, fewer outstanding requests, fewer failures,
        fewer requests so far (round robin among idle ones), then the given order."""
        now = self.clock()
        return sorted(self.instances, key=lambda i: (i.down_until > now, i.outstanding, i.failures, i.requests))

    def start(self, inst: Instance) -> None:
        inst.outstanding += 1
        inst.requests += 1

    def finish(self, inst: Instance, ok: bool) -> None:
        inst.outstanding -= 1
        if not ok:
            inst.failures += 1
            inst.down_until = self.clock() + self.backoff_s
        else:
            inst.down_until = 0.0

    def healthy(self) -> list[Instance]:
        now = self.clock()
        return [i for i in self.instances if i.down_until <= now]
