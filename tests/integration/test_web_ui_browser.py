"""The web UI in a real browser: Chromium from the system's packages (Debian's `chromium`; .ci/run installs it)
driven by Playwright, against a real `vllm-neuron serve` of the tiny Llama behind --api-key and --root-path /llm,
reached through the prefix as a proxy that keeps it would forward it.

The chat page asks for the key and then lists the model; a message streams its answer (several partial renders
before the end), survives a reload (localStorage), copies and regenerates; Stop mid-stream aborts the engine
request (the `abort` finish is counted and the KV pool is back to empty); the logprobs toggle colours each token
by its probability; JSON-schema mode constrains the answer, and an answer made of <script> and <img onerror>
renders as text; an image goes out as an image_url part and the text model's 400 is shown; a stream cut short
and an unreachable server leave the page usable, and a page opened while the server is down connects once it is
back. The dashboard's numbers move after requests.

VLLM_NEURON_UPDATE_SCREENSHOTS=1 writes the README's screenshots (docs/web_ui_*.png) from this run.
Skips, saying why, only where Playwright or Chromium is missing."""
from __future__ import annotations

import base64
import colorsys
import io
import json
import math
import os
import re
import shutil

import httpx
import pytest

from tests.integration.server_utils import serving, wait_for

pytestmark = pytest.mark.engine

KEY = "sk-web-ui"
MODEL = "tiny-llama"
ROOT = "/llm"
AUTH = {"Authorization": f"Bearer {KEY}"}
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs")
HOSTILE = "<script>window.__xss=1</script><img src=x onerror=window.__xss=2>"
CHROMIUM_PATHS = ("/usr/lib/chromium/chromium", "chromium", "chromium-browser")


def _chromium() -> str | None:
    for name in CHROMIUM_PATHS:
        path = name if os.path.isabs(name) else shutil.which(name)
        if path and os.access(path, os.X_OK):
            return path
    return None


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("Playwright is not installed (it is in the [test] extras: pip install -e '.[test]')")
    path = _chromium()
    if path is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium; .ci/run installs it)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory, browser):  # the browser first: no server starts for a skip
    args = ["--served-model-name", MODEL, "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024", "--num-gpu-blocks-override", "160",
            "--max-num-seqs", "4", "--api-key", KEY, "--root-path", ROOT, "--disable-uvicorn-access-log"]
    with serving(tiny_llama_dir, args, str(tmp_path_factory.mktemp("web_ui"))) as srv:
        srv.page_url = f"{srv.url}{ROOT}/"
        yield srv


@pytest.fixture(scope="module")
def context(browser, server):
    """A browser profile that has the key (as a user who entered it once)."""
    ctx = browser.new_context(viewport={"width": 1280, "height": 760})
    ctx.add_init_script(f"localStorage.setItem('vllm-neuron:api-key', {json.dumps(KEY)})")
    ctx.grant_permissions(["clipboard-read", "clipboard-write"])
    yield ctx
    ctx.close()


@pytest.fixture
def page(context, server):
    """The chat page with a new conversation; fails the test on any uncaught script error."""
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.page_url)
    until(page, "document.querySelector('#model').options.length > 0")
    page.click("#new-chat")
    yield page
    page.close()
    assert not errors, errors


def metric(server, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}{ROOT}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def until(page, expression: str, timeout: float = 30.0) -> None:
    """Polls a JS expression from here: Playwright's wait_for_function evaluates strings with eval, which the
    pages' Content-Security-Policy forbids (as it should)."""
    wait_for(lambda: page.evaluate(expression), timeout, interval=0.05, what=expression)


def settings(page, *, max_tokens: int | None = None, temperature: float | None = 0.0, logprobs: bool = False,
             schema: dict | None = None) -> None:
    page.fill("#max-tokens", "" if max_tokens is None else str(max_tokens))
    page.fill("#temperature", "" if temperature is None else str(temperature))
    page.set_checked("#logprobs", logprobs)
    page.set_checked("#json-mode", schema is not None)
    if schema is not None:
        page.fill("#json-schema", json.dumps(schema))


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_answer(page, timeout_ms: int = 60000):
    """The last assistant message once it is complete (its streaming ended, well or not)."""
    page.wait_for_selector(".message.assistant:not(.pending)", timeout=timeout_ms)
    return page.locator(".message.assistant").last


def test_the_page_asks_for_the_key_then_lists_the_model(browser, server):
    # The page and its scripts are public; the API is not.
    assert httpx.get(server.page_url).status_code == 200
    assert httpx.get(f"{server.url}{ROOT}/ui/chat.js").status_code == 200
    assert httpx.get(f"{server.url}{ROOT}/v1/models").status_code == 401
    wait_for(lambda: f"Web UI: {server.page_url} (chat)" in server.log(), 10, what="serve's line naming the page")
    ctx = browser.new_context()
    try:
        page = ctx.new_page()
        page.goto(server.page_url)
        page.wait_for_selector("#key-panel:not([hidden])")
        assert page.locator("#model option").count() == 0
        page.fill("#key-input", KEY)
        page.click("#key-save")
        until(page, "document.querySelector('#model').options.length > 0")
        assert page.input_value("#model") == MODEL
        assert page.text_content("#server-status") == "connected"
    finally:
        ctx.close()


def test_a_message_streams_its_answer_which_persists_copies_and_regenerates(page):
    settings(page, max_tokens=48)
    # The answer's bytes trickle in (Chromium's network emulation, ~4 KB/s: a couple of seconds for the answer):
    # on a loaded machine the tiny model's whole answer could otherwise reach the page in one read and render once.
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": 4096,
                                                  "uploadThroughput": -1})
    # Every text the answer shows on its way: more than a couple means it arrived in pieces.
    page.evaluate("""() => {
        window.__seen = new Set();
        new MutationObserver(() => {
            const body = document.querySelector('.message.assistant:last-child .body');
            if (body) window.__seen.add(body.textContent);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    send(page, "Hello there")
    answer = wait_answer(page)
    text = answer.locator(".body").inner_text()
    assert text.strip() and page.evaluate("window.__seen.size") >= 3, page.evaluate("[...window.__seen]")
    assert page.locator(".message.user .body").inner_text() == "Hello there"
    assert answer.locator(".error").count() == 0
    cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": -1,
                                                  "uploadThroughput": -1})

    answer.locator("button.copy").click()
    stored = json.loads(page.evaluate("localStorage.getItem('vllm-neuron:chat')"))
    assert page.evaluate("navigator.clipboard.readText()") == stored["messages"][-1]["content"]
    page.reload()
    page.wait_for_selector(".message.assistant")
    assert page.locator(".message").count() == 2 and page.locator(".message.assistant .body").inner_text() == text

    page.locator("button.regenerate").click()
    page.wait_for_selector(".message.assistant.pending", state="detached")
    assert page.locator(".message").count() == 2  # the answer replaced, not added
    assert page.locator(".message.assistant .body").inner_text() == text  # temperature 0: the same answer


def test_stop_mid_stream_aborts_the_request_and_frees_its_kv(page, server):
    wait_for(lambda: metric(server, "vllm:num_requests_running") == 0, 10, what="an idle engine")
    aborted = metric(server, "vllm:request_success_total", finished_reason="abort")
    by_length = metric(server, "vllm:request_success_total", finished_reason="length")
    settings(page, max_tokens=900, temperature=1.0)
    send(page, "Tell me a long story")
    until(page, "(document.querySelector('.message.assistant .body')?.textContent || '').length > 8")
    page.click("#stop")
    answer = wait_answer(page)
    assert answer.locator(".note").inner_text() == "Stopped."
    assert page.is_visible("#send") and not page.is_visible("#stop")
    wait_for(lambda: metric(server, "vllm:num_requests_running") == 0
             and metric(server, "vllm:kv_cache_usage_perc") == 0, 10, what="the engine to free the request")
    assert metric(server, "vllm:request_success_total", finished_reason="abort") == aborted + 1
    assert metric(server, "vllm:request_success_total", finished_reason="length") == by_length


def test_logprobs_colour_each_token_by_its_probability(page):
    page.fill("#system", "You are a terse assistant.")
    settings(page, max_tokens=16, temperature=1.0, logprobs=True)
    send(page, "Name a colour")
    answer = wait_answer(page)
    tokens = answer.locator(".token")
    n = tokens.count()
    assert n >= 2
    spans = tokens.evaluate_all("""spans => spans.map(s => ({text: s.textContent, logprob: Number(s.dataset.logprob),
                                                            colour: s.style.backgroundColor, title: s.title}))""")
    for s in spans:  # red (p = 0) to green (p = 1): the hue is 120 p degrees
        p = math.exp(s["logprob"])
        r, g, b = (round(255 * c) for c in colorsys.hls_to_rgb(round(120 * p) / 360, 0.82, 0.75))
        shown = [int(c) for c in re.findall(r"\d+", s["colour"])]
        assert s["logprob"] <= 0 and max(abs(x - y) for x, y in zip(shown, (r, g, b))) <= 1, (s, (r, g, b))
        assert s["title"].startswith(f"p = {p:.3f}")
    stored = json.loads(answer.page.evaluate("localStorage.getItem('vllm-neuron:chat')"))["messages"][-1]
    assert "".join(s["text"] for s in spans) == stored["content"]
    if os.environ.get("VLLM_NEURON_UPDATE_SCREENSHOTS") == "1":
        answer.page.screenshot(path=os.path.join(DOCS, "web_ui_chat.png"))
    page.fill("#system", "")


def test_json_schema_mode_and_an_answer_of_html_renders_as_text(page):
    settings(page, max_tokens=120, schema={"enum": [HOSTILE]})
    send(page, "Anything")
    answer = wait_answer(page)
    assert answer.locator(".error").count() == 0
    assert json.loads(answer.locator(".body").inner_text()) == HOSTILE  # the schema's one value, as JSON text
    assert answer.locator(".body script, .body img").count() == 0
    assert page.evaluate("window.__xss") is None
    # The renderer itself, on Markdown that tries links, fences and inline HTML.
    out = page.evaluate("""async () => {
        const { renderMarkdown } = await import(new URL('ui/markdown.js', document.baseURI));
        const box = document.createElement('div');
        box.append(renderMarkdown('# T\\n- a **<img src=x onerror=window.__xss=3>**\\n- [x](javascript:window.__xss=4)' +
                                  ' [ok](https://example.com)\\n\\n```html\\n<script>window.__xss=5</script>\\n```'));
        document.body.append(box);
        return {html: box.innerHTML, links: [...box.querySelectorAll('a')].map(a => a.href),
                items: box.querySelectorAll('li').length, code: box.querySelector('pre code').textContent,
                tags: [...box.querySelectorAll('*')].map(e => e.tagName.toLowerCase())};
    }""")
    assert out["links"] == ["https://example.com/"] and out["items"] == 2
    assert out["code"] == "<script>window.__xss=5</script>"
    assert not {"img", "script"} & set(out["tags"]) and {"h1", "strong", "pre"} <= set(out["tags"])
    assert "[x](javascript:window.__xss=4)" in out["html"]
    assert page.evaluate("window.__xss") is None


def test_an_image_goes_out_as_an_image_part_and_the_servers_400_is_shown(page, tmp_path):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, format="PNG")
    image = tmp_path / "red.png"
    image.write_bytes(buf.getvalue())
    settings(page, max_tokens=8)
    page.set_input_files("#image-input", str(image))
    page.wait_for_selector("#attachments img")
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as request:
        send(page, "What is this?")
    parts = request.value.post_data_json["messages"][-1]["content"]
    assert parts[0]["type"] == "image_url" and parts[1] == {"type": "text", "text": "What is this?"}
    assert base64.b64decode(parts[0]["image_url"]["url"].split(",", 1)[1]) == buf.getvalue()
    answer = wait_answer(page)
    assert "this model takes text only" in answer.locator(".error").inner_text()
    assert page.locator(".message.user img").count() == 1 and page.is_enabled("#send")


def test_a_lost_stream_and_an_unreachable_server_leave_the_page_usable(page):
    settings(page, max_tokens=8)
    chunk = {"choices": [{"index": 0, "delta": {"content": "partial"}, "finish_reason": None}]}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=f"data: {json.dumps(chunk)}\n\n"))
    send(page, "one")
    answer = wait_answer(page)
    assert answer.locator(".body").inner_text() == "partial" and "connection was lost" in answer.inner_text()
    page.unroute("**/v1/chat/completions")
    page.route("**/v1/chat/completions", lambda route: route.abort("connectionrefused"))
    send(page, "two")
    until(page, "document.querySelectorAll('.message.assistant:not(.pending) .error').length == 2")
    assert "cannot be reached" in page.locator(".message.assistant .error").last.inner_text()
    page.unroute("**/v1/chat/completions")
    send(page, "three")
    until(page, "document.querySelectorAll('.message.assistant:not(.pending)').length == 3")
    last = page.locator(".message.assistant").last
    assert last.locator(".error").count() == 0 and last.locator(".body").inner_text().strip()


def test_the_page_waits_for_a_server_that_is_down_and_connects_when_it_is_back(context, server):
    page = context.new_page()
    page.route("**/v1/models", lambda route: route.abort("connectionrefused"))
    page.goto(server.page_url)
    page.wait_for_selector("#notice:not([hidden])")
    assert "cannot be reached" in page.text_content("#notice") and page.text_content("#server-status") == "offline"
    page.unroute("**/v1/models")  # the server is back: the page's next try lists the model
    until(page, "document.querySelector('#model').options.length > 0", timeout=15)
    assert page.is_hidden("#notice") and page.text_content("#server-status") == "connected"
    page.close()


def test_the_dashboard_moves_after_requests(context, server):
    page = context.new_page()
    page.goto(f"{server.url}{ROOT}/dashboard")
    until(page, "document.querySelector('#m-finished').textContent !== '–'")

    def executions() -> int:
        return sum(int(x) for x in page.locator("#buckets td.executions").all_inner_texts())
    finished, steps = int(page.text_content("#m-finished")), executions()
    generated = int(page.text_content("#m-generated"))
    for _ in range(2):
        r = httpx.post(f"{server.url}{ROOT}/v1/completions", headers=AUTH, timeout=60,
                       json={"model": MODEL, "prompt": "Count: one two", "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200
    until(page, f"Number(document.querySelector('#m-finished').textContent) >= {finished + 2}")
    until(page, f"Number(document.querySelector('#m-generated').textContent) >= {generated + 16}")
    assert executions() > steps
    assert page.locator("#buckets tbody tr").count() >= 2  # a prefill and a decode bucket at least
    assert page.text_content("#m-ttft").endswith(")") and page.text_content("#server-status") == "connected"
    assert page.locator("#hist-ttft rect").count() >= 1 and page.locator("#plot-requests polyline").count() == 2
    if os.environ.get("VLLM_NEURON_UPDATE_SCREENSHOTS") == "1":
        page.screenshot(path=os.path.join(DOCS, "web_ui_dashboard.png"), full_page=True)
    page.close()
