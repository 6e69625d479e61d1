"""Encoder-disaggregated serving between real servers on the tiny Qwen3-VL: two encoder instances
(--mm-encoder-only, ECSharedStorageConnector producers), a prefill+decode instance without the vision tower
(mm_language_model_only, ec_consumer) and a monolithic server (the reference; an ec_consumer with the tower,
so it also shows a PD instance computing an item no encoder wrote), behind `vllm-neuron epd-proxy` as 1E+1PD
and 2E+1PD. Greedy fp32 tokens through the proxy equal the monolithic server's and transformers' for images of
two sizes, two images in one prompt and a short video (streamed too); encode jobs spread over both encoders;
an encoder that dies mid-job or is unreachable is skipped; with no encoder left the tower-less instance refuses
the request with a 400 naming the missing item (five in a row: refused before its engine, which keeps serving);
an item the tower-less instance holds is served from its encoder cache after the connector lost it."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import threading

import httpx
import pytest

from tests.integration.server_utils import ServerProcess, child_env, cli, free_port, wait_for
from tests.vlm_factory import data_url, hf_greedy, make_tiny_qwen3_vl, mp4_bytes, png_bytes, random_image, solid_image

pytestmark = pytest.mark.engine

MAX_NEW = 6
ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "64",
        "--max-num-seqs", "4"]
ENCODER = {"encoder_neuron_config": {"encoder_attention_block_size": 256}}  # small buckets: a fast eager tower


def _ec(role: str, folder: str) -> list[str]:
    return ["--ec-transfer-config", json.dumps({"ec_connector": "ECSharedStorageConnector", "ec_role": role,
                                                "ec_connector_extra_config": {"shared_storage_path": folder}})]


class _Proxy:
    def __init__(self, encode: list[str], pd: list[str], tmp: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp, f"epd-proxy-{self.port}.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cli() + ["epd-proxy", "--encode", *encode, "--pd", *pd, "--port", str(self.port),
                                              "--encode-timeout", "20"], env=child_env(tmp), stdout=self._log,
                                     stderr=subprocess.STDOUT)
        wait_for(self._up, 30, what="the epd-proxy")

    def _up(self) -> bool:
        assert self.proc.poll() is None, open(self.log_path).read()
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()


class _DyingEncoder:
    """Accepts a connection, reads the request and closes without an answer: an encoder dying mid-job."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.jobs = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(65536)
            self.jobs += 1
            conn.close()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("epd")
    tmp, folder = str(root), str(root / "ec")
    os.mkdir(folder)
    model = make_tiny_qwen3_vl(str(root / "model"))
    enc, pd_config = ["--additional-config", json.dumps(ENCODER)], json.dumps({**ENCODER, "mm_language_model_only": True})
    servers = {"e1": ServerProcess(model, ARGS + enc + ["--mm-encoder-only"] + _ec("ec_producer", folder), tmp),
               "e2": ServerProcess(model, ARGS + enc + ["--mm-encoder-only"] + _ec("ec_producer", folder), tmp),
               "pd": ServerProcess(model, ARGS + ["--additional-config", pd_config] + _ec("ec_consumer", folder), tmp),
               "mono": ServerProcess(model, ARGS + enc + _ec("ec_consumer", folder), tmp)}
    proxies = {}
    dying = _DyingEncoder()
    try:
        for s in servers.values():
            s.wait_healthy(timeout=180)
        e1, e2, pd = servers["e1"].url, servers["e2"].url, servers["pd"].url
        proxies = {"1e": _Proxy([e1], [pd], tmp), "2e": _Proxy([e1, e2], [pd], tmp),
                   "faulty": _Proxy([dying.url, f"http://127.0.0.1:{free_port()}", e2], [pd], tmp),
                   "none": _Proxy([dying.url], [pd], tmp)}
        yield servers, proxies, model, folder, dying
    finally:
        for p in proxies.values():
            p.stop()
        dying.sock.close()
        for s in servers.values():
            s.kill()  # nothing here tests a graceful stop: the process groups go at once


def _messages(parts: list[dict], text: str = "Describe.") -> list[dict]:
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def _image(img) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(png_bytes(img))}}


def _chat(url: str, model: str, messages: list[dict], stream: bool = False) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": messages, "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True,
        "stream": stream})


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


CASES = {
    "small image": [_image(random_image(56, 84, 0))],
    "large image": [_image(random_image(112, 140, 1))],
    "two images": [_image(solid_image(56, 56, (200, 30, 30))), _image(random_image(84, 56, 2))],
    "video": [{"type": "video_url", "video_url": {"url": data_url(mp4_bytes(8, 4), "video/mp4")}}],
}


@pytest.mark.parametrize("case", list(CASES))
def test_epd_tokens_equal_the_monolithic_server(fleet, case):
    servers, proxies, model, _, _ = fleet
    messages = _messages(CASES[case])
    reference = _text(_chat(servers["mono"].url, model, messages))
    for kind in ("1e", "2e"):
        assert _text(_chat(proxies[kind].url, model, messages)) == reference, kind


def test_images_equal_transformers_and_stream_through(fleet):
    from transformers import AutoTokenizer

    servers, proxies, model, _, _ = fleet
    tok = AutoTokenizer.from_pretrained(model)
    imgs = [random_image(56, 56, 7), random_image(84, 112, 8)]
    messages = _messages([_image(i) for i in imgs])
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = tok.decode(hf_greedy(tok.encode(text, add_special_tokens=False), imgs, MAX_NEW))
    assert _text(_chat(proxies["2e"].url, model, messages)) == ref
    r = _chat(proxies["1e"].url, model, messages, stream=True)
    assert r.status_code == 200
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == ref


def test_encode_jobs_spread_and_embeddings_come_from_the_encoders(fleet):
    servers, proxies, model, folder, _ = fleet
    before = {k: _metric(servers[k].url, 'vllm_neuron:ec_items_total{source="encoded"}') for k in ("e1", "e2")}
    imgs = [_image(random_image(56, 56, 20 + i)) for i in range(4)]
    for img in imgs:
        assert _text(_chat(proxies["2e"].url, model, _messages([img])))
    after = {k: _metric(servers[k].url, 'vllm_neuron:ec_items_total{source="encoded"}') for k in ("e1", "e2")}
    assert after["e1"] - before["e1"] == 2 and after["e2"] - before["e2"] == 2  # round robin among idle ones
    assert _metric(proxies["2e"].url, "vllm_neuron_proxy:ec_bytes_total") > 0
    assert any(name.endswith(".ec") for name in os.listdir(folder))


def test_an_encoder_dying_mid_job_is_skipped(fleet):
    servers, proxies, model, _, dying = fleet
    messages = _messages([_image(random_image(56, 84, 30))])
    jobs = dying.jobs
    assert _text(_chat(proxies["faulty"].url, model, messages)) == _text(_chat(servers["mono"].url, model, messages))
    assert dying.jobs == jobs + 1


def test_no_encoder_left_fails_the_request_clearly_and_the_pd_keeps_serving(fleet):
    servers, proxies, model, _, _ = fleet
    for _ in range(5):  # more than the engine's consecutive step failures: refused before the engine
        r = _chat(proxies["none"].url, model, _messages([_image(random_image(70, 70, 40))]))
        assert r.status_code == 400, r.text
        assert "no encoder instance provided the embeddings of image 0" in r.json()["error"]["message"]
    assert _text(_chat(proxies["none"].url, model, [{"role": "user", "content": "Hi."}]))  # text goes straight to PD
    assert _text(_chat(proxies["1e"].url, model, _messages([_image(random_image(56, 56, 41))])))


def test_encoder_refuses_bad_media_with_a_400(fleet):
    servers, proxies, model, _, _ = fleet
    r = _chat(proxies["1e"].url, model, _messages([{"type": "image_url",
                                                     "image_url": {"url": data_url(b"not an image")}}]))
    assert r.status_code == 400, r.text
    assert "cannot decode" in r.json()["error"]["message"]
    assert httpx.get(servers["e1"].url + "/health", timeout=5).status_code == 200


def test_an_item_the_pd_instance_holds_is_not_asked_for_again(fleet):
    servers, proxies, model, folder, _ = fleet
    messages = _messages([_image(random_image(56, 70, 50))], text="Hi.")  # shorter than a KV block: no prefix hit
    hits = _metric(servers["pd"].url, "vllm_neuron:encoder_cache_hits_total")
    first = _text(_chat(proxies["1e"].url, model, messages))
    for name in os.listdir(folder):  # every embedding gone from the connector
        os.unlink(os.path.join(folder, name))
    assert _text(_chat(servers["pd"].url, model, messages)) == first  # straight to the PD: its encoder cache
    assert _metric(servers["pd"].url, "vllm_neuron:encoder_cache_hits_total") == hits + 1
