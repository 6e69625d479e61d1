"""What the HTTP layer refuses before any work, over real HTTP against the fake engine: media type
(415), body size (413), JSON nesting (400), lone UTF-16 surrogates (replaced), `n` over --max-n,
seeds outside 64 bits, request chat templates without --trust-request-chat-template, 405 with
Allow, and /openapi.json describing all of it (plus a bounded schemathesis run: no 5xx).
"""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from vllm_neuron.entrypoints.openai.api_server import build_app
from vllm_neuron.entrypoints.openai.request_body import MAX_JSON_DEPTH
from vllm_neuron.entrypoints.openai.request_policy import RequestLimits

from tests.integration.fake_engine import FakeEngine
from tests.integration.test_openai_fake_engine import serve, tokenizer  # noqa: F401 - module fixture

MODEL = "smol"
MAX_N = 4
MAX_BODY = 64 * 1024
CHAT = [{"role": "user", "content": "hi"}]
JSON_ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


@pytest.fixture(scope="module")
def engine(tokenizer):  # noqa: F811
    return FakeEngine(tokenizer, max_model_len=256)


@pytest.fixture(scope="module")
def base_url(engine):
    app = build_app(engine, served_model_names=[MODEL], limits=RequestLimits(max_n=MAX_N, max_body_bytes=MAX_BODY))
    with serve(app) as url:
        yield url


@pytest.fixture(scope="module")
def trusted_url(engine):
    app = build_app(engine, served_model_names=[MODEL], limits=RequestLimits(trust_request_chat_template=True))
    with serve(app) as url:
        yield url


def _error(r: httpx.Response, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param
    return err["message"]


def _still_serves(url: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


@pytest.mark.parametrize("path", JSON_ROUTES)
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_non_json_media_type_is_415(base_url, path, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(base_url + path, content=json.dumps({"prompt": "x", "tokens": [1]}), headers=headers)
    assert "application/json" in _error(r, 415)
    r = httpx.post(base_url + path, content=b'{"prompt": "x", "tokens": [1]}',
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code != 415


def test_oversize_body_is_413_before_reading(base_url):
    big = json.dumps({"prompt": "x" * MAX_BODY}).encode()
    r = httpx.post(base_url + "/tokenize", content=big, headers={"content-type": "application/json"})
    assert "--max-request-body-bytes" in _error(r, 413)

    def chunks():  # no Content-Length: the limit is enforced while reading
        for i in range(0, len(big), 4096):
            yield big[i:i + 4096]

    r = httpx.post(base_url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    _error(r, 413)
    # A declared size over the limit is refused before the body arrives: the client never sends it.
    with socket.create_connection(("127.0.0.1", int(base_url.rsplit(":", 1)[1])), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n")
        assert s.recv(200).startswith(b"HTTP/1.1 413")
    _still_serves(base_url)


@pytest.mark.parametrize("body", [
    b"[" * 20_000 + b"]" * 20_000,
    b'{"prompt": "x", "stop": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",
    b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": ' + b"[" * 20_000
    + b"]" * 20_000 + b"}}",
    b'{"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"a": '
    + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}}",
], ids=["top", "stop-20k", "template-kwargs-20k", "template-kwargs-just-over"])
def test_deeply_nested_json_is_400(base_url, body):
    r = httpx.post(base_url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert "nested deeper" in _error(r, 400) or "JSON object" in r.json()["error"]["message"]
    _still_serves(base_url)


def test_lone_surrogates_are_replaced(base_url, engine, tokenizer):  # noqa: F811
    raw = b'{"prompt": "a\\ud800b", "max_tokens": 2}'
    r = httpx.post(base_url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    call = list(engine.calls.values())[-1]
    assert call.prompt_ids == tokenizer.encode("a\ufffdb")
    raw = b'{"messages": [{"role": "user", "content": "\\udfff hi \\ud83d\\ude00"}], "max_tokens": 2}'
    r = httpx.post(base_url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert "\ufffd hi \U0001F600" in list(engine.calls.values())[-1].prompt_text  # the valid pair is kept
    raw = b'{"prompt": "\\uD800"}'
    r = httpx.post(base_url + "/tokenize", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode("\ufffd")


def test_n_is_bounded(base_url):
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = httpx.post(base_url + path, json={**body, "n": 1000, "max_tokens": 1, "temperature": 1.0})
        assert "--max-n" in _error(r, 400, "n")
        r = httpx.post(base_url + path, json={**body, "n": MAX_N, "max_tokens": 1, "temperature": 1.0})
        assert r.status_code == 200 and len(r.json()["choices"]) == MAX_N


def test_seed_is_64_bit(base_url):
    for seed in (2 ** 64, 2 ** 63, -(2 ** 63) - 1):
        r = httpx.post(base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "seed": seed})
        _error(r, 400, "seed")
    for seed in (2 ** 63 - 1, -(2 ** 63), -1):
        r = httpx.post(base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "seed": seed})
        assert r.status_code == 200, r.text


def test_request_chat_template_needs_trust(base_url, trusted_url, tokenizer):  # noqa: F811
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    for path in ("/tokenize", "/v1/chat/completions"):
        r = httpx.post(base_url + path, json={"messages": CHAT, "chat_template": template, "max_tokens": 1})
        assert "--trust-request-chat-template" in _error(r, 400, "chat_template")
    r = httpx.post(trusted_url + "/tokenize", json={"messages": CHAT, "chat_template": template})
    assert r.status_code == 200 and r.json()["tokens"] == tokenizer.encode("<<hi>>", add_special_tokens=False)
    r = httpx.post(trusted_url + "/v1/chat/completions", json={"messages": CHAT, "chat_template": "{% for %}"})
    _error(r, 400, "messages")  # a broken trusted template is still the request's fault


def test_heavy_request_leaves_the_loop_free(trusted_url):
    """A trusted template that loops for seconds runs off the event loop: /health and a running
    stream keep answering meanwhile."""
    spin = "{% for i in range(80000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}"
    done: dict[str, float] = {}

    def heavy() -> None:
        t0 = time.monotonic()
        r = httpx.post(trusted_url + "/tokenize", json={"messages": CHAT, "chat_template": spin}, timeout=120)
        assert r.status_code == 200
        done["heavy"] = time.monotonic() - t0

    worker = threading.Thread(target=heavy)
    worker.start()
    time.sleep(0.3)  # the render is under way
    worst = 0.0
    while worker.is_alive():
        t0 = time.monotonic()
        assert httpx.get(trusted_url + "/health", timeout=30).status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.05)
    worker.join()
    assert done["heavy"] > 0.5, "the template did not take long enough to measure anything"
    # Relative bound: a blocked loop stalls /health for most of the render (>= 0.7x of it); a free
    # one answers in milliseconds, but a loaded 2-core machine can stretch that past a fixed 0.5 s.
    assert worst < done["heavy"] / 3, f"/health stalled {worst:.2f} s while a {done['heavy']:.1f} s template rendered"


def test_unsupported_method_is_405(base_url):
    r = httpx.get(base_url + "/v1/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"]
    assert r.json()["error"]["type"] == "MethodNotAllowedError"


def test_openapi_describes_the_routes(base_url):
    doc = httpx.get(base_url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path in JSON_ROUTES:
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"], path
        assert {"200", "400", "413", "415", "500"} <= set(op["responses"]), path
    seed = schemas["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert (seed["minimum"], seed["maximum"]) == (-(2 ** 63), 2 ** 63 - 1)
    n = schemas["ChatCompletionRequest"]["properties"]["n"]["anyOf"][0]
    assert (n["minimum"], n["maximum"]) == (1, MAX_N)
    assert "text/event-stream" in doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    # What the routes refuse is stated (schemathesis' positive_data_acceptance found these refused as valid):
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["chat_template"]["type"] == "null"
    item = chat["messages"]["items"]
    assert item["properties"]["role"]["minLength"] == 1 and {"content"} in [set(v["required"]) for v in item["anyOf"]]
    formats = next(o for o in chat["response_format"]["anyOf"] if o.get("type") == "object")["anyOf"]
    assert {"format"} in [set(v.get("required", [])) for v in formats]


@pytest.mark.parametrize("messages, param", [
    ([{"role": "", "content": "hi"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
])
def test_malformed_messages_are_named(base_url, messages, param):
    r = httpx.post(base_url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert "Chat template error" not in _error(r, 400, param)
    _still_serves(base_url)


def test_structural_tag_without_a_format_is_a_400(base_url):
    r = httpx.post(base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                                       "response_format": {"type": "structural_tag"}})
    assert "structural_tag" in _error(r, 400, "response_format")


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(base_url, tmp_path):
    """A bounded schemathesis run, fixed seed: the coverage phase (every boundary value of every field: 1,300
    cases, 60 s) on the two generation routes, whose request schemas are the largest and most used, and the
    fuzzing phase on every route (15 examples each). Checks: no 5xx, every status code and content type
    documented, every schema-violating request refused, 405 on undeclared methods. Schema-valid requests may
    still get a 400 for what no schema states (the context length, n > 1 when greedy, ...), so
    positive_data_acceptance is left out. (The coverage phase on every route takes 2,700 cases and twice the
    time for the same kinds of finding; run it with `--phases coverage` by hand after schema changes.)"""
    checks = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
              "response_schema_conformance", "negative_data_rejection", "unsupported_method"]
    runs = [["--phases", "coverage", "--include-path-regex", "^/v1/(chat/)?completions$"],
            ["--phases", "fuzzing", "--max-examples", "15"]]
    for run in runs:
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", base_url + "/openapi.json", "--seed", "1", *run,
               "--checks", ",".join(checks), "--request-timeout", "30", "--no-color"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
        assert re.search(r"\b[1-9]\d+ generated", res.stdout), res.stdout[-2000:]
