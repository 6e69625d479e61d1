"""Two measurements against a running server (issue 42), printed as text:

    python benchmarks/hostile_load.py stall URL --schema 10k|1k|slow40 [--stream-tokens 2500]
        one stream; 2 s in, a chat request whose JSON schema is heavy to compile: its status and time, and
        the stream's gaps between chunks before, while and after it ran.
    python benchmarks/hostile_load.py overload URL --clients 4 [--seconds 90]
        the sustainable rate (closed loop, --clients = max_num_seqs), then Poisson arrivals at 2x and 4x it:
        200s, 503s (with Retry-After), the admitted requests' latency.

Start the server yourself, e.g. `vllm-neuron serve --enforce-eager --max-num-seqs 4`.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import threading
import time

import httpx

SCHEMAS = {
    "10k": lambda: {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10_000)}},
    "1k": lambda: {"type": "object", "properties": {f"q{i}": {"type": "string"} for i in range(1_000)}},
    # Within every default size limit, several seconds of compilation (40 long repetitions).
    "slow40": lambda: {"type": "object", "required": ["p0"], "properties": {
        f"p{i}": {"type": "string", "pattern": f"[a-z]{{0,{1900 + i}}}"} for i in range(40)}},
}


def _gaps(xs: list[float]) -> str:
    return f"n={len(xs)} mean {statistics.mean(xs):.3f} s max {max(xs):.3f} s" if xs else "n=0"


def stall(url: str, schema: str, stream_tokens: int) -> None:
    arrivals: list[float] = []

    def stream() -> None:
        body = {"prompt": "Once upon", "max_tokens": stream_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=1800) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(2.0)
    g0 = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", timeout=1800, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[schema]()}}})
    g1 = time.monotonic()
    t.join()
    gaps = [(b, b - a) for a, b in zip(arrivals, arrivals[1:])]
    print(f"{schema}: grammar request {r.status_code} in {g1 - g0:.2f} s: {r.text[:120]}")
    print(f"  stream gaps before: {_gaps([g for at, g in gaps if at < g0])}; while it ran: "
          f"{_gaps([g for at, g in gaps if g0 <= at <= g1 + 0.5])}; after: {_gaps([g for at, g in gaps if at > g1 + 0.5])}")


async def _one(c: httpx.AsyncClient, url: str, out: list) -> None:
    t = time.monotonic()
    try:
        r = await c.post(url + "/v1/completions", json={"prompt": "Tell me", "max_tokens": 48, "ignore_eos": True})
        out.append((r.status_code, time.monotonic() - t, r.headers.get("retry-after")))
    except httpx.HTTPError as e:
        out.append((type(e).__name__, time.monotonic() - t, None))


async def _overload(url: str, clients: int, seconds: float) -> None:
    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[int(p * (len(xs) - 1))] if xs else float("nan")

    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=4000)) as c:
        done: list = []
        end = time.monotonic() + seconds / 2

        async def loop() -> None:
            while time.monotonic() < end:
                await _one(c, url, done)

        t0 = time.monotonic()
        await asyncio.gather(*[loop() for _ in range(clients)])
        rate = len(done) / (time.monotonic() - t0)
        print(f"sustainable: {rate:.2f} req/s (closed loop, {clients} clients, 48 tokens each)")
        rng = random.Random(0)
        for mult in (2, 4):
            await asyncio.sleep(5)
            out: list = []
            tasks = []
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                tasks.append(asyncio.create_task(_one(c, url, out)))
                await asyncio.sleep(rng.expovariate(mult * rate))
            await asyncio.gather(*tasks)
            codes = [o[0] for o in out]
            ok = [o[1] for o in out if o[0] == 200]
            rejected = [o[1] for o in out if o[0] == 503]
            print(f"{mult}x ({mult * rate:.2f} req/s for {seconds:.0f} s): {len(out)} sent, {len(ok)} ok, "
                  f"{len(rejected)} 503 ({100 * len(rejected) / max(1, len(out)):.0f}%), other "
                  f"{[x for x in codes if x not in (200, 503)][:5]}; ok latency p50 {q(ok, .5):.1f} s p95 "
                  f"{q(ok, .95):.1f} s; 503 answered in p50 {q(rejected, .5) * 1000:.0f} ms; Retry-After "
                  f"{sorted({o[2] for o in out if o[0] == 503})}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("stall")
    s.add_argument("url")
    s.add_argument("--schema", choices=sorted(SCHEMAS), default="10k")
    s.add_argument("--stream-tokens", type=int, default=2500)
    o = sub.add_parser("overload")
    o.add_argument("url")
    o.add_argument("--clients", type=int, default=4)
    o.add_argument("--seconds", type=float, default=90.0)
    args = p.parse_args()
    if args.what == "stall":
        stall(args.url.rstrip("/"), args.schema, args.stream_tokens)
    else:
        asyncio.run(_overload(args.url.rstrip("/"), args.clients, args.seconds))


if __name__ == "__main__":
    main()
