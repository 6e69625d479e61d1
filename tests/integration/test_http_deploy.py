"""Deploying behind TLS and a proxy, with request logs: serve's own flags (parsed by the real `vllm-neuron`
parser) -> HttpOptions -> build_app + uvicorn, against the fake engine (tests/integration/fake_engine.py) over
real HTTPS on 127.0.0.1. Certificates are made here with the openssl command (self-signed, EC P-256).

One server for the module: HTTPS with optional client certificates (--ssl-cert-reqs 1, the client CA given),
--root-path /llm, CORS for one origin with credentials, request logs cut to 12 characters with outputs.
"""
from __future__ import annotations

import logging
import os
import re
import ssl
import subprocess

import httpx
import pytest

from tests.integration.fake_engine import FakeEngine, serve_app
from tests.integration.server_utils import free_port, run_cli
from vllm_neuron.entrypoints.cli.main import _parser
from vllm_neuron.entrypoints.openai.api_server import build_app
from vllm_neuron.entrypoints.openai.server_options import HttpOptions
from vllm_neuron.model.loader import load_tokenizer

MODEL = "smol"
ORIGIN = "https://ui.example"


def _cert(folder, name: str) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key: (certfile, keyfile)."""
    crt, key = os.path.join(folder, f"{name}.crt"), os.path.join(folder, f"{name}.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", crt, "-days", "2", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return crt, key


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("certs"))
    return {name: _cert(folder, name) for name in ("server", "client", "rogue")}


def serve_args(*flags: str):
    return _parser().parse_args(["serve", *flags])


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(load_tokenizer(), max_model_len=256)  # the bundled model's (its conversion is cached)


@pytest.fixture(scope="module")
def base_url(engine, certs):
    (crt, key), (client_crt, _) = certs["server"], certs["client"]
    http = HttpOptions.from_args(serve_args(
        "--ssl-certfile", crt, "--ssl-keyfile", key, "--ssl-ca-certs", client_crt, "--ssl-cert-reqs", "1",
        "--root-path", "/llm", "--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods", "GET", "POST",
        "--allow-credentials", "--enable-log-requests", "--max-log-len", "12", "--enable-log-outputs"))
    app = build_app(engine, served_model_names=[MODEL], **http.app_kwargs())
    with serve_app(app, **http.uvicorn_kwargs()) as port:
        yield f"https://127.0.0.1:{port}"


def client_for(certs, cert: str | None = None) -> httpx.Client:
    ctx = ssl.create_default_context(cafile=certs["server"][0])
    if cert is not None:
        ctx.load_cert_chain(*certs[cert])
    return httpx.Client(verify=ctx, timeout=30)


def test_https_with_a_self_signed_certificate_and_client_certificates(base_url, certs):
    with client_for(certs) as c:  # --ssl-cert-reqs 1: a client without a certificate is served
        assert c.get(base_url + "/llm/v1/models").json()["data"][0]["id"] == MODEL
    with client_for(certs, "client") as c:  # one signed by --ssl-ca-certs too
        assert c.get(base_url + "/llm/health").status_code == 200
    with client_for(certs, "rogue") as c, pytest.raises(httpx.HTTPError):  # one signed by nobody it trusts is not
        c.get(base_url + "/llm/health")
    with httpx.Client(timeout=10) as c, pytest.raises(httpx.ConnectError):  # the system CAs do not know it
        c.get(base_url + "/llm/health")
    with httpx.Client(timeout=10) as c, pytest.raises(httpx.HTTPError):  # plain HTTP on the HTTPS port
        c.get(base_url.replace("https", "http") + "/llm/health")


def test_root_path_routes_with_and_without_the_prefix(base_url, certs):
    with client_for(certs) as c:
        assert c.get(base_url + "/llm/v1/models").status_code == 200  # a proxy that keeps the prefix
        assert c.get(base_url + "/v1/models").status_code == 200  # one that strips it
        assert c.get(base_url + "/llm/openapi.json").json()["servers"] == [{"url": "/llm"}]
        assert "/llm/openapi.json" in c.get(base_url + "/llm/docs").text
        assert c.get(base_url + "/llm/nope").status_code == 404


def test_cors_for_the_allowed_origin_only(base_url, certs):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    with client_for(certs) as c:
        ok = c.options(base_url + "/llm/v1/completions", headers={"Origin": ORIGIN, **preflight})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        assert ok.headers["access-control-allow-credentials"] == "true"
        assert "DELETE" not in ok.headers["access-control-allow-methods"]
        bad = c.options(base_url + "/llm/v1/completions", headers={"Origin": "https://evil.example", **preflight})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        put = c.options(base_url + "/llm/v1/completions", headers={"Origin": ORIGIN,
                                                                  "Access-Control-Request-Method": "DELETE"})
        assert put.status_code == 400


def test_x_request_id_is_honoured_and_echoed(base_url, certs, engine):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    with client_for(certs) as c:
        r = c.post(base_url + "/llm/v1/completions", json=body, headers={"X-Request-Id": "trace-42"})
        assert r.headers["x-request-id"] == "trace-42" and r.json()["id"] == "cmpl-trace-42"
        assert "cmpl-trace-42-0" in engine.calls
        chat = c.post(base_url + "/llm/v1/chat/completions", headers={"X-Request-Id": "trace-43"},
                      json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert chat.headers["x-request-id"] == "trace-43" and chat.json()["id"] == "chatcmpl-trace-43"
        # Without the header, the body's request_id (vLLM's field), else a new id, is the one echoed.
        r = c.post(base_url + "/llm/v1/completions", json={**body, "request_id": "from-body"})
        assert r.headers["x-request-id"] == "from-body" and r.json()["id"] == "cmpl-from-body"
        r = c.post(base_url + "/llm/v1/completions", json=body)
        assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
        assert c.get(base_url + "/llm/health", headers={"X-Request-Id": "probe"}).headers["x-request-id"] == "probe"
        assert len(c.get(base_url + "/llm/health").headers["x-request-id"]) == 32
        long = c.get(base_url + "/llm/health", headers={"X-Request-Id": "x" * 257})
        assert long.status_code == 400 and "X-Request-Id" in long.json()["error"]["message"]


def test_request_and_output_logs_and_the_access_log(base_url, certs, engine, caplog):
    access: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: access.append(record.getMessage())
    logging.getLogger("uvicorn.access").addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="vllm_neuron"), client_for(certs) as c:
            r = c.post(base_url + "/llm/v1/completions", headers={"X-Request-Id": "logged"},
                       json={"model": MODEL, "prompt": "The quick brown fox jumps", "max_tokens": 3, "seed": 3})
            assert r.status_code == 200
    finally:
        logging.getLogger("uvicorn.access").removeHandler(handler)
    lines = [rec.getMessage() for rec in caplog.records if "cmpl-logged-0" in rec.getMessage()]
    received = next(ln for ln in lines if ln.startswith("Received request cmpl-logged-0: "))
    assert "prompt: 'The quick br'," in received  # --max-log-len 12
    ids = engine.calls["cmpl-logged-0"].prompt_ids
    assert f"prompt_token_ids: {ids[:12]}," in received and "seed=3" in received and "priority: 0" in received
    generated = next(ln for ln in lines if ln.startswith("Generated response cmpl-logged-0 (choice 0): "))
    text = r.json()["choices"][0]["text"]
    assert f"output: {text[:12]!r}," in generated and generated.endswith("finish_reason: length")
    assert any('"POST /llm/v1/completions HTTP/1.1" 200' in a for a in access), access


def test_options_refuse_what_they_cannot_honour(certs, tmp_path):
    (crt, key), (client_crt, client_key) = certs["server"], certs["client"]
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    cases = [
        (["--ssl-certfile", crt, "--ssl-keyfile", "/no/such.key"], "--ssl-keyfile /no/such.key: no such file"),
        (["--ssl-certfile", str(garbage), "--ssl-keyfile", key], f"--ssl-certfile {garbage}: not a PEM certificate"),
        (["--ssl-certfile", crt, "--ssl-keyfile", client_key], f"--ssl-keyfile {client_key}: not a PEM private key "
                                                               "matching the certificate"),
        (["--ssl-certfile", crt, "--ssl-keyfile", key, "--ssl-ca-certs", str(garbage)], "--ssl-ca-certs"),
        (["--ssl-keyfile", key], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-ca-certs", client_crt], "need HTTPS"),
        (["--ssl-certfile", crt, "--ssl-keyfile", key, "--ssl-cert-reqs", "2"], "pass --ssl-ca-certs"),
        (["--root-path", "llm/"], "--root-path must start with '/'"),
        (["--enable-log-outputs"], "pass --enable-log-requests"),
        (["--allowed-origins", "[1, 2]"], "--allowed-origins must be a JSON list of strings"),
    ]
    for flags, match in cases:
        with pytest.raises(ValueError, match=re.escape(match)):
            HttpOptions.from_args(serve_args(*flags))
    defaults = HttpOptions.from_args(serve_args())
    assert defaults.uvicorn_kwargs() == {"log_level": "info", "access_log": True}
    assert HttpOptions.from_args(serve_args("--disable-uvicorn-access-log", "--uvicorn-log-level", "warning")
                                 ).uvicorn_kwargs() == {"log_level": "warning", "access_log": False}


def test_serve_fails_at_start_naming_a_wrong_tls_file(tmp_path):
    res = run_cli(["serve", "--port", str(free_port()), "--ssl-certfile", "/no/such/cert.pem", "--ssl-keyfile",
                   "/no/such/key.pem"], str(tmp_path), timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "error: --ssl-certfile /no/such/cert.pem: no such file" in res.stderr
