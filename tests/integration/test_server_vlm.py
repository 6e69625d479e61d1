"""`vllm-neuron serve` on the tiny Qwen3-VL: the openai SDK's chat with a data: image gives
transformers' greedy tokens; a file:// image under --allowed-local-media-path works; a broken image,
an unsupported media type, too many images and a path outside the allowed folder each get a 400
naming the problem, and the server keeps serving. http(s) images come from --allowed-media-domains hosts
only (here `localhost`, served by a thread of this test), never from an address a redirect or the
literal IP of a host not listed points at."""
from __future__ import annotations

import os
import re

import httpx
import openai
import pytest

from tests.integration.server_utils import ServerProcess
from tests.media_host import media_host
from tests.vlm_factory import IMAGE, data_url, hf_greedy, make_tiny_qwen3_vl, mp4_bytes, png_bytes, random_image

pytestmark = pytest.mark.engine

MAX_NEW = 6




@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_server")
    model_dir = make_tiny_qwen3_vl(str(root / "model"))
    media = root / "media"
    media.mkdir()
    srv = ServerProcess(model_dir, ["--enforce-eager", "--dtype", "float32", "--max-model-len", "256",
                                    "--num-gpu-blocks-override", "64", "--max-num-seqs", "4",
                                    "--limit-mm-per-prompt", '{"image": 2}', "--allowed-local-media-path",
                                    str(media), "--allowed-media-domains", "localhost"], str(root))
    try:
        srv.wait_healthy(timeout=120)
        yield srv, model_dir, str(media)
    finally:
        srv.stop()
        srv.kill()


def _message(*urls: str, text: str = "Describe.") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def _chat(srv, model_dir, messages):
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model=model_dir, messages=messages, max_tokens=MAX_NEW, temperature=0.0,
                                          extra_body={"ignore_eos": True})


def test_openai_sdk_chat_with_a_data_image_matches_transformers(setup):
    srv, model_dir, _ = setup
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    img = random_image(56, 84, 0)
    messages = _message(data_url(png_bytes(img)))
    out = _chat(srv, model_dir, messages)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.count(IMAGE) == 1
    ref = hf_greedy(tok.encode(text, add_special_tokens=False), [img], MAX_NEW)
    assert out.choices[0].message.content == tok.decode(ref)
    assert out.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False)) - 1 + 6  # 6 image tokens


def test_file_url_under_the_allowed_folder(setup):
    srv, model_dir, media = setup
    path = os.path.join(media, "cat.png")
    with open(path, "wb") as f:
        f.write(png_bytes(random_image(56, 56, 1)))
    out = _chat(srv, model_dir, _message("file://" + path))
    assert out.choices[0].finish_reason == "length"


@pytest.mark.parametrize("urls, needle", [
    ([data_url(b"definitely not an image")], "cannot decode the data: URL image"),
    ([data_url(b"hello", "text/plain")], "media type 'text/plain' of the data: URL is not supported"),
    ([data_url(png_bytes(random_image(56, 56, 2)))] * 3, "At most 2 image(s) may be provided in one prompt, got 3"),
    (["file:///etc/hostname"], "outside the allowed local media folder"),
])
def test_bad_media_get_a_400_and_the_server_keeps_serving(setup, urls, needle):
    srv, model_dir, _ = setup
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                   json={"model": model_dir, "messages": _message(*urls), "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    ok = _chat(srv, model_dir, _message(data_url(png_bytes(random_image(56, 56, 3)))))
    assert ok.choices[0].finish_reason == "length"


def _metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_encoder_cache_hits_and_misses_in_metrics(setup):
    srv, model_dir, _ = setup
    hits, misses = (_metric(srv, f"vllm_neuron:encoder_cache_{k}_total") for k in ("hits", "misses"))
    url = data_url(png_bytes(random_image(56, 56, 9)))
    first = _chat(srv, model_dir, _message(url, text="Hi."))
    second = _chat(srv, model_dir, _message(url, text="Hi."))  # shorter than a KV block: no prefix-cache hit
    assert first.choices[0].message.content == second.choices[0].message.content
    assert _metric(srv, "vllm_neuron:encoder_cache_misses_total") == misses + 1
    assert _metric(srv, "vllm_neuron:encoder_cache_hits_total") == hits + 1


def test_video_url_content_part(setup):
    srv, model_dir, _ = setup
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": data_url(mp4_bytes(8, 4), "video/mp4")}},
        {"type": "text", "text": "What happens?"}]}]
    out = _chat(srv, model_dir, messages)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens > 2 * 4  # two frame pairs of 4 tokens, their timestamps and markers


def test_bench_serve_random_mm(setup, tmp_path):
    """`vllm-neuron bench serve --dataset-name random-mm` against the server: every request with its images
    succeeds."""
    from tests.integration.server_utils import run_cli

    srv, model_dir, _ = setup
    out = run_cli(["bench", "serve", "--backend", "openai-chat", "--base-url", srv.url, "--model", model_dir,
                   "--tokenizer", model_dir, "--dataset-name", "random-mm", "--num-prompts", "3",
                   "--random-input-len", "16", "--random-output-len", "4", "--random-mm-base-items-per-request", "2",
                   "--random-mm-limit-mm-per-prompt", '{"image": 2, "video": 1}',
                   "--random-mm-bucket-config", "{(56, 56, 1): 0.5, (56, 84, 1): 0.3, (56, 56, 4): 0.2}",
                   "--ignore-eos", "--disable-tqdm"], str(tmp_path), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"Successful requests:\s+3", out.stdout), out.stdout


def test_tokenize_counts_the_image_tokens(setup):
    srv, model_dir, _ = setup
    body = {"model": model_dir, "messages": _message(data_url(png_bytes(random_image(56, 84, 0))))}
    with_image = httpx.post(srv.url + "/tokenize", json=body, timeout=60).json()
    text_only = httpx.post(srv.url + "/tokenize", timeout=60, json={
        "model": model_dir, "messages": [{"role": "user", "content": [{"type": "text", "text": "Describe."}]}]}).json()
    # <|vision_start|> + 6 image tokens + <|vision_end|> more than the text-only conversation
    assert with_image["count"] == text_only["count"] + 8


@pytest.fixture(scope="module")
def media():
    with media_host(png_bytes(random_image(56, 56, 5))) as host:
        yield host


def test_http_media_only_from_allowed_hosts(setup, media):
    srv, model_dir, _ = setup
    media_port = media.port
    media.requests.clear()
    ok = _chat(srv, model_dir, _message(f"http://localhost:{media_port}/cat.png"))  # listed: fetched
    assert ok.choices[0].finish_reason == "length" and media.requests == ["/cat.png"]
    for url, needle in [
        (f"http://127.0.0.1:{media_port}/cat.png", "'127.0.0.1' is not in --allowed-media-domains"),
        ("http://169.254.169.254/latest/meta-data/", "'169.254.169.254' is not in --allowed-media-domains"),
        # A listed host's redirect to an address that is not: refused at that hop, never fetched.
        (f"http://localhost:{media_port}/to/http://127.0.0.1:{media_port}/cat.png",
         "'127.0.0.1' is not in --allowed-media-domains"),
    ]:
        media.requests.clear()
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=60,
                       json={"model": model_dir, "messages": _message(url), "max_tokens": 2})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
        assert "/cat.png" not in media.requests
