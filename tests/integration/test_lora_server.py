"""`vllm-neuron serve --enable-lora` on the tiny random Llama: adapters from --lora-modules (both forms) chosen by
the `model` field and listed by /v1/models, answers equal to transformers with the adapter merged; runtime
load / unload (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), unloading an adapter while its request streams, the bad
inputs (unknown adapter, malformed folder, rank too large, a target the base lacks) answered with OpenAI error
objects while the server keeps serving; vllm:lora_requests_info in /metrics. One server for the module."""
from __future__ import annotations

import json
import shutil
import threading

import httpx
import pytest

from tests.integration.server_utils import serving
from tests.model_factory import build_tiny_llama, cached_greedy_reference, make_peft_adapter, merged_lora_model

pytestmark = pytest.mark.engine

PROMPT = [1, 504, 3060, 12, 991, 4410, 77, 2301, 45, 800, 17]
MAX_NEW = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict:
    """name -> (folder, reference tokens of PROMPT under it); None -> the base model's tokens."""
    hf = build_tiny_llama()
    out = {None: (None, cached_greedy_reference(hf, [PROMPT], MAX_NEW)[0])}
    for i, (name, r) in enumerate((("a", 8), ("b", 4), ("c", 16)), 1):
        path = make_peft_adapter(str(tmp_path_factory.mktemp(f"srv_lora_{name}")), hf, r=r, seed=10 + i)
        out[name] = (path, cached_greedy_reference(merged_lora_model(hf, path), [PROMPT], MAX_NEW)[0])
    return out


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("lora_server"))
    args = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "128", "--num-gpu-blocks-override", "64",
            "--max-num-seqs", "4", "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", "16", "--lora-modules", f"a={adapters['a'][0]}",
            json.dumps({"name": "b", "path": adapters["b"][0], "base_model_name": "base"})]
    with serving(tiny_llama_dir, args, tmp, timeout=120, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1") as srv:
        yield srv


def _complete(server, model: str, **kw) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0, **kw}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60)


def _tokens(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return [int(t.removeprefix("token_id:")) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]


def _error(resp: httpx.Response, status: int, words: str) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert words in err["message"] and err["code"] == status and err["type"], err


def test_models_lists_adapters_with_parent(server, adapters):
    cards = {c["id"]: c for c in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
    assert cards["a"]["parent"] == "base" and cards["a"]["root"] == adapters["a"][0]
    assert cards["b"]["parent"] == "base" and cards["base"]["parent"] is None


def test_adapter_chosen_per_request(server, adapters):
    for name in ("a", "base", "b", "a"):
        want = adapters[None if name == "base" else name][1]
        assert _tokens(_complete(server, name, return_tokens_as_token_ids=True)) == want, name
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["model"] == "b"


def test_unknown_adapter_is_404(server):
    _error(_complete(server, "nope"), 404, "The model `nope` does not exist.")


def test_runtime_load_bad_inputs(server, adapters, tmp_path):
    load = server.url + "/v1/load_lora_adapter"
    good = adapters["c"][0]

    def variant(name: str, **config) -> str:
        d = tmp_path / name
        shutil.copytree(good, d)
        cfg = json.loads((d / "adapter_config.json").read_text())
        cfg.update(config)
        (d / "adapter_config.json").write_text(json.dumps(cfg))
        return str(d)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{oops")
    cases = [({"lora_name": "x"}, "Both 'lora_name' and 'lora_path' must be provided."),
             ({"lora_name": "x", "lora_path": str(tmp_path / "none")}, "not an existing folder"),
             ({"lora_name": "x", "lora_path": str(broken)}, "is not valid JSON"),
             ({"lora_name": "x", "lora_path": variant("big", r=32)}, "rank r=32 is above max_lora_rank=16"),
             ({"lora_name": "x", "lora_path": variant("fc", target_modules=["fc1"])},
              "target module 'fc1' is not in the base model"),
             ({"lora_name": "a", "lora_path": good}, "has already been loaded")]
    for body, words in cases:
        _error(httpx.post(load, json=body, timeout=10), 400, words)
    _error(httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "x"}, timeout=10), 404,
           "cannot be found")
    assert _tokens(_complete(server, "a", return_tokens_as_token_ids=True)) == adapters["a"][1]  # still serving


def test_runtime_load_then_unload_while_streaming(server, adapters):
    """c is loaded at run time (three adapters, two slots), streams while it is unloaded: the running request
    finishes with c's tokens, later requests naming c get a 404."""
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"][0]},
                   timeout=10)
    assert r.status_code == 200 and "added successfully" in r.text
    assert _tokens(_complete(server, "c", return_tokens_as_token_ids=True)) == adapters["c"][1]

    body = {"model": "c", "prompt": PROMPT, "max_tokens": 60, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_tokens_as_token_ids": True, "logprobs": 0}
    first = threading.Event()
    tokens: list[int] = []

    def stream() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])["choices"][0]
                    tokens.extend(int(t.removeprefix("token_id:")) for t in (chunk.get("logprobs") or {}).get(
                        "tokens", []))
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(30)
    r = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=10)
    assert r.status_code == 200 and "removed successfully" in r.text
    t.join(60)
    assert len(tokens) == 60 and tokens[:MAX_NEW] == adapters["c"][1]
    _error(_complete(server, "c"), 404, "does not exist")
    ids = [c["id"] for c in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]]
    assert "c" not in ids and "a" in ids


def test_lora_metrics(server):
    _complete(server, "b")
    text = httpx.get(server.url + "/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:lora_requests_info{")]
    assert lines and all('max_lora="2"' in ln for ln in lines)
    assert any('running_lora_adapters="b"' in ln for ln in lines)
