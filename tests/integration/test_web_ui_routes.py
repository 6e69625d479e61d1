"""The web UI's routes over real HTTP on the fake engine (tests/integration/fake_engine.py), built from serve's own
flags: the pages and every asset they load, the Content-Security-Policy, the HTML 404 outside the API (the API's
unknown paths keep the JSON error object), the pages public and the API guarded under --api-key and
--api-key-all-routes, --root-path in the pages' <base href>, and --disable-webui. The pages themselves run in a
browser in test_web_ui_browser.py."""
from __future__ import annotations

import re
from contextlib import contextmanager

import httpx
import pytest

from tests.integration.fake_engine import FakeEngine, serve_app
from vllm_neuron.entrypoints.cli.main import _parser
from vllm_neuron.entrypoints.openai.api_server import build_app
from vllm_neuron.entrypoints.openai.server_options import HttpOptions
from vllm_neuron.model.loader import load_tokenizer

MODEL = "smol"
KEY = "sk-page"


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(load_tokenizer(), max_model_len=256)


@contextmanager
def served(engine, *flags: str):
    """The app `vllm-neuron serve FLAGS` would build around `engine`, on a free port: its base URL."""
    args = _parser().parse_args(["serve", *flags])
    http = HttpOptions.from_args(args)
    app = build_app(engine, served_model_names=[MODEL], api_key=args.api_key,
                    api_key_all_routes=args.api_key_all_routes, **http.app_kwargs())
    with serve_app(app, **http.uvicorn_kwargs()) as port:
        yield f"http://127.0.0.1:{port}"


def _is_error_object(r: httpx.Response) -> bool:
    return r.headers["content-type"].startswith("application/json") and "message" in r.json()["error"]


def test_pages_and_every_asset_they_load_are_served(engine):
    with served(engine) as url, httpx.Client(base_url=url, timeout=10) as c:
        seen = set()
        for page in ("/", "/dashboard"):
            r = c.get(page)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert '<base href="/">' in r.text
            policy = r.headers["content-security-policy"]
            assert "script-src 'self'" in policy and "unsafe-inline" not in policy and "default-src 'none'" in policy
            assets = re.findall(r'(?:src|href)="(ui/[^"]+)"', r.text)
            assert any(a.endswith(".js") for a in assets) and "ui/style.css" in assets
            seen.update(assets)
        # The modules' own imports (./common.js ...), followed to the end.
        todo = [a for a in seen if a.endswith(".js")]
        while todo:
            r = c.get("/" + todo.pop())
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript"), r.url
            for name in re.findall(r'from "\./([\w.-]+\.js)"', r.text):
                if f"ui/{name}" not in seen:
                    seen.add(f"ui/{name}")
                    todo.append(f"ui/{name}")
        for asset in seen:
            assert c.get("/" + asset).status_code == 200, asset
        assert {"ui/chat.js", "ui/dashboard.js", "ui/common.js", "ui/markdown.js", "ui/prometheus.js"} <= seen
        # Not part of the API's description.
        paths = c.get("/openapi.json").json()["paths"]
        assert not {"/", "/dashboard"} & set(paths) and not any(p.startswith("/ui/") for p in paths)


def test_unknown_paths_get_an_html_page_and_api_paths_keep_the_error_object(engine):
    with served(engine) as url, httpx.Client(base_url=url, timeout=10) as c:
        for path in ("/nope", "/ui/nope.js", "/ui/index.html", "/dashboard/x", "/v1x"):
            r = c.get(path)
            assert r.status_code == 404 and r.headers["content-type"].startswith("text/html"), path
            assert "404" in r.text and '<base href="/">' in r.text
        for path in ("/v1/nope", "/v1", "/v2/nope"):
            r = c.get(path)
            assert r.status_code == 404 and _is_error_object(r), path
        r = c.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and _is_error_object(r)
        r = c.get("/v1/chat/completions")  # a known path with the wrong method: the API's 405
        assert r.status_code == 405 and _is_error_object(r)


def test_the_pages_are_public_and_the_api_stays_guarded(engine):
    with served(engine, "--api-key", KEY) as url, httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/").status_code == 200 and c.get("/ui/chat.js").status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    with served(engine, "--api-key", KEY, "--api-key-all-routes") as url, httpx.Client(base_url=url, timeout=10) as c:
        for path in ("/", "/dashboard", "/ui/dashboard.js", "/ui/style.css"):
            assert c.get(path).status_code == 200, path
        for path in ("/metrics", "/v1/models", "/nope", "/openapi.json"):
            r = c.get(path)
            assert r.status_code == 401 and _is_error_object(r), path
        assert c.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_root_path_is_the_pages_base(engine):
    with served(engine, "--root-path", "/llm") as url, httpx.Client(base_url=url, timeout=10) as c:
        for path in ("/llm/", "/llm/dashboard", "/"):  # a proxy that keeps the prefix, and one that strips it
            r = c.get(path)
            assert r.status_code == 200 and '<base href="/llm/">' in r.text, path
        assert c.get("/llm/ui/chat.js").status_code == 200
        r = c.get("/llm", follow_redirects=True)
        assert r.status_code == 200 and str(r.url).endswith("/llm/") and '<base href="/llm/">' in r.text
        assert '<base href="/llm/">' in c.get("/llm/nope").text
    # The prefix is the operator's text: escaped in the attribute.
    with served(engine, "--root-path", '/a"b<c') as url, httpx.Client(base_url=url, timeout=10) as c:
        assert '<base href="/a&quot;b&lt;c/">' in c.get("/").text


def test_disable_webui_leaves_the_server_as_it_was(engine):
    with served(engine, "--disable-webui") as url, httpx.Client(base_url=url, timeout=10) as c:
        for path in ("/", "/dashboard", "/ui/chat.js", "/nope"):
            r = c.get(path)
            assert r.status_code == 404 and _is_error_object(r), path
        assert c.get("/v1/models").status_code == 200
