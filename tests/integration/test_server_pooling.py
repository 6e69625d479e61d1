"""`vllm-neuron serve` of a pooling model (issue 48): /v1/embeddings through the openai SDK (float and base64)
against transformers' last-token hidden states, token-id input, Matryoshka dimensions and truncation,
usage counts, /pooling, /score and /rerank (cosine similarity of an embedder), the bad-input 400s, and the
server still serving after them. One server for the module (a tiny Qwen3-Embedding-shaped checkpoint)."""
from __future__ import annotations

import base64
import json
import os

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.integration.server_utils import ServerProcess
from tests.model_factory import build_tiny_model, make_tiny_model

pytestmark = pytest.mark.engine

MODEL = "tiny-embed"
MAX_LEN = 128
TOL = 1e-5


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(checkpoint dir, transformers Qwen3Model)."""
    hf = build_tiny_model("qwen3", seed=7)
    path = make_tiny_model(str(tmp_path_factory.mktemp("embedder")), "qwen3", model=hf.model)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "is_matryoshka": True}, f)
    return path, hf.model


@pytest.fixture(scope="module")
def server(embedder, tmp_path_factory):
    srv = ServerProcess(embedder[0], ["--enforce-eager", "--dtype", "float32", "--max-model-len", str(MAX_LEN),
                                      "--num-gpu-blocks-override", "64", "--max-num-seqs", "4",
                                      "--served-model-name", MODEL], str(tmp_path_factory.mktemp("server")))
    try:
        srv.wait_healthy(timeout=90)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _reference(hf_model, ids: list[int], dims: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        last = hf_model(torch.tensor([ids])).last_hidden_state[0, -1].float()
    return F.normalize(last[:dims] if dims else last, dim=-1)


def test_openai_sdk_embeddings_float_and_base64_match_transformers(client, embedder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedder[0])
    texts = ["The quick brown fox", "jumps over the lazy dog, again and again and again"]
    as_float = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    as_b64 = client.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
    sdk_default = client.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64 and decodes it
    ids = [tok.encode(t) for t in texts]
    assert as_float.usage.prompt_tokens == as_float.usage.total_tokens == sum(len(i) for i in ids)
    for i, t_ids in enumerate(ids):
        ref = _reference(embedder[1], t_ids)
        assert (torch.tensor(as_float.data[i].embedding) - ref).abs().max().item() < TOL
        assert np.frombuffer(base64.b64decode(as_b64.data[i].embedding), dtype="<f4").tolist() == \
            as_float.data[i].embedding
        assert sdk_default.data[i].embedding == as_float.data[i].embedding
        assert as_float.data[i].index == i


def test_token_ids_dimensions_and_truncation(client, embedder):
    ids = list(range(200, 240))
    out = client.embeddings.create(model=MODEL, input=[ids, ids[:5]], dimensions=16, encoding_format="float")
    assert len(out.data[0].embedding) == 16
    assert (torch.tensor(out.data[1].embedding) - _reference(embedder[1], ids[:5], 16)).abs().max().item() < TOL
    long = list(range(300, 300 + MAX_LEN + 20))
    cut = client.embeddings.create(model=MODEL, input=long, encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 10})
    assert cut.usage.prompt_tokens == 10
    assert (torch.tensor(cut.data[0].embedding) - _reference(embedder[1], long[-10:])).abs().max().item() < TOL


@pytest.mark.parametrize("body,param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": list(range(5, 5 + MAX_LEN + 1))}, "input"),
    ({"input": "hi", "dimensions": 999}, "dimensions"),
    ({"input": [[1, 2], [10**9]]}, "input"),
])
def test_bad_embedding_requests_are_400s(server, body, param):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_generation_routes_refuse_a_pooling_model_and_the_server_keeps_serving(server, client):
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": [
        {"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400 and "pooling model" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
    assert r.status_code == 400, r.text
    assert len(client.embeddings.create(model=MODEL, input="still here", encoding_format="float").data) == 1


def test_pooling_score_and_rerank_follow_the_embeddings(server, client):
    docs = ["a fox in the woods", "stock prices fell", "the fox ran away"]
    query = "where is the fox"
    embs = client.embeddings.create(model=MODEL, input=[query, *docs], encoding_format="float").data
    e = [torch.tensor(d.embedding) for d in embs]
    cos = [F.cosine_similarity(e[0][None], d[None]).item() for d in e[1:]]
    pooled = httpx.post(server.url + "/pooling", json={"model": MODEL, "input": query}, timeout=30).json()
    assert pooled["data"][0]["data"] == embs[0].embedding
    score = httpx.post(server.url + "/score", json={"model": MODEL, "text_1": query, "text_2": docs}, timeout=30)
    assert [round(d["score"], 5) for d in score.json()["data"]] == [round(c, 5) for c in cos], score.text
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(server.url + path, json={"model": MODEL, "query": query, "documents": docs, "top_n": 2},
                       timeout=30).json()
        assert [x["index"] for x in r["results"]] == sorted(range(3), key=lambda i: -cos[i])[:2]
        assert r["results"][0]["document"]["text"] == docs[r["results"][0]["index"]]
        assert r["usage"]["total_tokens"] > 0
    r = httpx.post(server.url + "/classify", json={"model": MODEL, "input": "hi"}, timeout=30)
    assert r.status_code == 400 and "not served by this model" in r.json()["error"]["message"]
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert any(line.startswith("vllm:request_success_total") and not line.rstrip().endswith(" 0.0")
               for line in metrics.splitlines())
