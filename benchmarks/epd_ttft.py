"""Encoder-disaggregated serving (EPD) against one server, same run, on this machine's cores (issue 45).

    python benchmarks/epd_ttft.py [--model QWEN3_VL_FOLDER] [--requests 8] [--image-size 224] [--eager]

1E+1PD: an encoder instance (--mm-encoder-only) pinned to core 0 and a prefill+decode instance without the
vision tower pinned to core 1, sharing an ECSharedStorageConnector folder, behind `vllm-neuron epd-proxy`;
against one monolithic server on both cores. Each gets the same chat requests with one image (a fresh image
per request, so no encoder cache hit), streamed, one at a time and 4 concurrent; TTFT is the time to the first
streamed chunk that carries text (as `vllm-neuron bench serve`). From the encoder's /metrics: embedding bytes
written per request and the encode job's time (processing, tower, file write) as a share of the EPD TTFT.
Without --model it builds the tests' tiny random Qwen3-VL (then HTTP and scheduling dominate: read the ratios,
not the milliseconds).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

VENV_BIN = os.path.dirname(sys.executable)
CLI = [os.path.join(VENV_BIN, "vllm-neuron")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], cores: str, log: str, tmp: str) -> subprocess.Popen:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": tempfile.mkdtemp(dir=tmp), "VLLM_NEURON_LOG_LEVEL": "WARNING"}
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


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in "{ ")


def _image_url(size: int, seed: int) -> str:
    import base64
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def _ttft(client: httpx.AsyncClient, url: str, model: str, image: str) -> float:
    body = {"model": model, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": "Describe the image."}]}]}
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: {r.status_code} {await r.aread()}")
        first = None
        async for line in r.aiter_lines():  # as `vllm-neuron bench serve`: the first chunk that carries text
            if first is None and line.startswith("data: {"):
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0]["delta"].get("content"):
                    first = time.perf_counter() - t0
        if first is None:
            raise SystemExit(f"{url}: the stream carried no text")
        return first


async def _load(url: str, model: str, images: list[str], concurrency: int) -> list[float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(img: str) -> float:
            async with sem:
                return await _ttft(client, url, model, img)
        return list(await asyncio.gather(*(one(i) for i in images)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Qwen3-VL folder (default: the tests' tiny random one)")
    ap.add_argument("--requests", type=int, default=8, help="requests per load (default 8)")
    ap.add_argument("--image-size", type=int, default=224, help="square images of this many pixels a side")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--eager", action="store_true", help="--enforce-eager on every server")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="epd_bench_")
    model = args.model
    if model is None:
        sys.path.insert(0, REPO)
        from tests.vlm_factory import make_tiny_qwen3_vl

        model = make_tiny_qwen3_vl(os.path.join(tmp, "model"))
    folder = os.path.join(tmp, "ec")
    os.mkdir(folder)
    common = ["--disable-log-stats", "--max-model-len", str(args.max_model_len)] + (["--enforce-eager"] if args.eager else [])
    ec = lambda role: ["--ec-transfer-config", json.dumps({  # noqa: E731
        "ec_connector": "ECSharedStorageConnector", "ec_role": role,
        "ec_connector_extra_config": {"shared_storage_path": folder}})]
    loads = [(1, "one at a time"), (4, "4 concurrent")]
    seed = iter(range(10**6))
    batches = {c: [_image_url(args.image_size, next(seed)) for _ in range(args.requests)] for c, _ in loads}
    results: dict[str, list[float]] = {}
    ep, pp, xp, sp = (_port() for _ in range(4))
    e = _start(["serve", model, "--port", str(ep), *common, "--mm-encoder-only", *ec("ec_producer")], "0",
               f"{tmp}/e.log", tmp)
    p = _start(["serve", model, "--port", str(pp), *common, "--additional-config",
                json.dumps({"mm_language_model_only": True}), *ec("ec_consumer")], "1", f"{tmp}/pd.log", tmp)
    e_url, p_url, x_url = (f"http://127.0.0.1:{n}" for n in (ep, pp, xp))
    epd: dict[int, dict] = {}
    try:
        _wait(e_url, e, f"{tmp}/e.log")
        _wait(p_url, p, f"{tmp}/pd.log")
        x = _start(["epd-proxy", "--encode", e_url, "--pd", p_url, "--port", str(xp)], "0-1", f"{tmp}/x.log", tmp)
        try:
            _wait(x_url, x, f"{tmp}/x.log", 60)
            asyncio.run(_load(x_url, model, [_image_url(args.image_size, 10**7)], 1))  # warm-up
            for c, _ in loads:
                b0, s0 = (_metric(e_url, n) for n in ("vllm_neuron:ec_bytes_written_total",
                                                       "vllm_neuron:ec_encode_seconds_sum"))
                results[f"epd-c{c}"] = asyncio.run(_load(x_url, model, batches[c], c))
                epd[c] = {"bytes": (_metric(e_url, "vllm_neuron:ec_bytes_written_total") - b0) / args.requests,
                          "encode_s": (_metric(e_url, "vllm_neuron:ec_encode_seconds_sum") - s0) / args.requests}
        finally:
            _stop(x)
    finally:
        _stop(e, p)
    s = _start(["serve", model, "--port", str(sp), *common], "0-1", f"{tmp}/s.log", tmp)
    s_url = f"http://127.0.0.1:{sp}"
    try:
        _wait(s_url, s, f"{tmp}/s.log")
        asyncio.run(_load(s_url, model, [_image_url(args.image_size, 10**7 + 1)], 1))
        for c, _ in loads:
            results[f"single-c{c}"] = asyncio.run(_load(s_url, model, batches[c], c))
    finally:
        _stop(s)

    print(f"\n{args.requests} chat requests with one {args.image_size}x{args.image_size} image each (8 tokens out); "
          "EPD = encoder on core 0 + PD on core 1 + proxy; single = one server on both cores")
    print("| load | TTFT median single | TTFT median EPD | ratio | embedding bytes per request | "
          "encode job (tower + write) per request | its share of EPD TTFT |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c, name in loads:
        sg, dg = statistics.median(results[f"single-c{c}"]) * 1000, statistics.median(results[f"epd-c{c}"]) * 1000
        enc = epd[c]["encode_s"] * 1000
        print(f"| {name} | {sg:.0f} ms | {dg:.0f} ms | {dg / sg:.2f} | {epd[c]['bytes'] / 1024:.1f} KiB | "
              f"{enc:.1f} ms | {100 * enc / dg:.0f}% |")
    print(f"(logs in {tmp})")


if __name__ == "__main__":
    main()
