"""A bounded soak test: mixed valid, invalid and disconnecting traffic plus distinct JSON schemas against the real
`vllm-neuron serve` on a tiny Llama for N minutes, then: no 5xx answer (every invalid request a 4xx), the
engine idle with its KV cache empty, and the API server's, the engine's and the grammar compile process'
RSS within RSS_BOUND_MB of their level after warm-up.

Length: VLLM_NEURON_SOAK_MINUTES (default 1.25: CI's `make test` runs it so; `make soak` runs 30).
VLLM_NEURON_SOAK_CSV=path writes the RSS samples (seconds, MB of each process, requests sent) for a plot.
The grammar caches are bounded small (--grammar-cache-bytes) so that they fill within the short run:
memory that only grew would show there too.
"""
from __future__ import annotations

import csv
import json
import os
import random
import threading
import time
from collections import Counter

import httpx
import pytest

from tests.integration.server_utils import serving, wait_for

pytestmark = pytest.mark.soak

MINUTES = float(os.environ.get("VLLM_NEURON_SOAK_MINUTES", "1.25"))
CSV_PATH = os.environ.get("VLLM_NEURON_SOAK_CSV")
WORKERS = 6  # under --max-num-queued-reqs: a 503 would be a fault here
WARMUP_FRACTION = 0.4  # the first 40% of the run (at least 30 s) settles caches, arenas and KV pages
RSS_BOUND_MB = 100  # growth allowed after warm-up, per process (the tail's floor against the early peak)
CACHE_BYTES = 16 << 20
ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "64",
        "--max-num-seqs", "4", "--max-num-queued-reqs", "16", "--grammar-cache-bytes", str(CACHE_BYTES),
        "--grammar-compile-timeout", "5", "--body-read-timeout", "5", "--max-n", "4"]


def _rss_mb(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024
    except (OSError, StopIteration):
        return 0.0


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in "{ ")


class Traffic:
    """One worker's requests: each kind expects a status class; what came back is counted by kind."""

    def __init__(self, url: str, seed: int) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.statuses: Counter = Counter()
        self.unexpected: list[str] = []

    def _record(self, kind: str, status: int | str, ok: bool, detail: str = "") -> None:
        self.statuses[(kind, status)] += 1
        if not ok:
            self.unexpected.append(f"{kind}: {status} {detail[:300]}")

    def _post(self, kind: str, path: str, want: int, timeout: float = 600, **kw) -> None:
        r = httpx.post(self.url + path, timeout=timeout, **kw)
        self._record(kind, r.status_code, r.status_code == want, r.text)

    def one(self) -> None:
        kinds = [self.completion, self.chat_stream, self.stream_and_leave, self.give_up, self.invalid,
                 self.new_schema, self.oversized_schema, self.big_prompt, self.tokenize]
        self.rng.choices(kinds, weights=[4, 4, 2, 1, 4, 3, 1, 1, 1])[0]()

    def completion(self) -> None:
        self._post("completion", "/v1/completions", 200, json={
            "prompt": f"Count {self.rng.randint(0, 10**6)}", "max_tokens": self.rng.randint(4, 32),
            "n": self.rng.choice([1, 1, 2]), "temperature": 0.8})

    def chat_stream(self) -> None:
        body = {"messages": [{"role": "user", "content": f"Tell {self.rng.random()}"}], "stream": True,
                "max_tokens": self.rng.randint(8, 48), "stream_options": {"include_usage": True}}
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=600) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        events = [json.loads(x[len("data: "):]) for x in lines[:-1]]
        ok = r.status_code == 200 and lines[-1] == "data: [DONE]" and not any("error" in e for e in events)
        self._record("chat_stream", r.status_code, ok, "\n".join(lines[-3:]))

    def stream_and_leave(self) -> None:
        body = {"prompt": "Go on and on", "stream": True, "max_tokens": 200, "ignore_eos": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=600) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 2:
                    break  # the client leaves mid-stream
        self._record("stream_and_leave", r.status_code, r.status_code == 200)

    def give_up(self) -> None:
        try:
            httpx.post(self.url + "/v1/completions", timeout=0.3,
                       json={"prompt": "Slowly", "max_tokens": 200, "ignore_eos": True})
            self._record("give_up", "finished", True)
        except httpx.TimeoutException:
            self._record("give_up", "left", True)

    def invalid(self) -> None:
        body, want = self.rng.choice([
            (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400),
            (b'{"prompt": "hi", "logit_bias": {"1": NaN}}', 400),
            (b'{"prompt": "hi"', 400),
            (b'{"prompt": "hi", "n": 99}', 400),
            (b'{"prompt": "hi", "model": "nope"}', 404),
            (b'{"prompt": "hi", "max_tokens": 100000}', 400),
            (json.dumps({"messages": [{"role": ""}]}).encode(), 400),
        ])
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        self._post("invalid", path, want, content=body, headers={"content-type": "application/json"})

    def new_schema(self) -> None:
        names = [f"k{self.rng.randint(0, 10**9)}" for _ in range(self.rng.randint(3, 40))]
        schema = {"type": "object", "properties": {n: {"type": self.rng.choice(["string", "integer", "boolean"])}
                                                   for n in names}, "required": names[:1]}
        body = {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 40,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
        r = httpx.post(self.url + "/v1/chat/completions", timeout=600, json=body)
        if r.status_code == 503 and "grammar compiler is busy" in r.text:
            # The back-pressure the server is built to give when schemas queue past --grammar-compile-timeout
            # (its two cores shared with another test worker): it says retry, and the OpenAI clients do.
            self._record("new_schema", "503 busy, retried", True)
            time.sleep(1.0)
            r = httpx.post(self.url + "/v1/chat/completions", timeout=600, json=body)
        self._record("new_schema", r.status_code, r.status_code == 200, r.text)

    def oversized_schema(self) -> None:
        schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
        self._post("oversized_schema", "/v1/chat/completions", 400, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})

    def big_prompt(self) -> None:
        prompt = "lorem ipsum " * 90_000  # ~1 MB: refused before tokenizing, or tokenized whole when truncated
        if self.rng.random() < 0.5:
            self._post("big_prompt", "/v1/completions", 400, json={"prompt": prompt, "max_tokens": 4})
        else:
            self._post("big_prompt_truncated", "/v1/completions", 200,
                       json={"prompt": prompt, "max_tokens": 4, "truncate_prompt_tokens": 32})

    def tokenize(self) -> None:
        self._post("tokenize", "/tokenize", 200, json={"prompt": "some words " * self.rng.randint(1, 50)})


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with serving(tiny_llama_dir, ARGS, str(tmp_path_factory.mktemp("soak")), timeout=180) as srv:
        yield srv


def test_soak(server):
    duration = MINUTES * 60
    warmup = max(30.0, WARMUP_FRACTION * duration)
    t0 = time.monotonic()
    deadline = t0 + duration
    workers = [Traffic(server.url, seed) for seed in range(WORKERS)]
    sent = [0]

    def run(w: Traffic) -> None:
        while time.monotonic() < deadline:
            try:
                w.one()
            except httpx.HTTPError as e:  # a reset or a timeout the client did not ask for
                w._record("transport", type(e).__name__, False, str(e))
            sent[0] += 1

    threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    engine = server.engine_pid()
    samples: list[tuple[float, float, float, float, int]] = []
    while any(t.is_alive() for t in threads):
        samples.append((time.monotonic() - t0, _rss_mb(server.proc.pid), _rss_mb(engine),
                        _rss_mb(server.child_running(b"vllm_neuron.structured_output.checker")), sent[0]))
        time.sleep(2.0)
    for t in threads:
        t.join(900)
    if CSV_PATH:
        with open(CSV_PATH, "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["seconds", "api_rss_mb", "engine_rss_mb", "grammar_compile_rss_mb", "requests"])
            out.writerows((round(s, 1), round(a, 1), round(e, 1), round(g, 1), n) for s, a, e, g, n in samples)

    statuses = sum((w.statuses for w in workers), Counter())
    unexpected = [u for w in workers for u in w.unexpected]
    assert not unexpected, f"{len(unexpected)} unexpected answers, e.g. {unexpected[:5]}\n{statuses}"
    assert not [k for k in statuses if isinstance(k[1], int) and k[1] >= 500], statuses
    assert "Exception in ASGI application" not in server.log() and "Traceback" not in server.log()

    # The engine empties: nothing running or waiting, no KV block held, nothing admitted.
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm_neuron:num_requests_admitted"):
        wait_for(lambda name=name: _metric(server.url, name) == 0, 30, what=f"{name} back to 0")
    assert _metric(server.url, "vllm_neuron:grammar_cache_bytes") <= 2 * CACHE_BYTES * 1.1  # API + engine caches

    # RSS levels off: its floor over the last third of the run within RSS_BOUND_MB of its high-water mark right
    # after warm-up. The API server's RSS swings by up to 230 MB for tens of seconds while 1 MB prompts are
    # tokenized and answered, then drops back at a trim (673 MB at 24 s, 456 six seconds later, here); a
    # median of the last few samples that fell in such a swing failed CI once (452 -> 627 MB). A leak raises the
    # floor with the requests served; a swing does not. The base's peak: malloc arenas still swing there too.
    settled = [s for s in samples if s[0] >= warmup]
    assert len(settled) >= 10, f"too few samples after warm-up ({len(samples)} in all)"
    base = settled[:max(5, len(settled) // 10)]
    tail = settled[-max(5, len(settled) // 3):]
    for col, name in ((1, "API server"), (2, "engine"), (3, "grammar compile process")):
        level = max(s[col] for s in base)
        end = min(s[col] for s in tail)
        assert end <= level + RSS_BOUND_MB, (f"{name} RSS grew from a peak of {level:.0f} MB after warm-up to a "
                                             f"floor of {end:.0f} MB over the last third of the run "
                                             f"(bound {RSS_BOUND_MB} MB); samples: {samples[::10]}")
    print(f"soak: {sent[0]} requests in {duration:.0f} s; {dict(statuses)}")
