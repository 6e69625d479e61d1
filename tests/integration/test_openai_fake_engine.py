"""The OpenAI-compatible server against a fake engine, over real HTTP (uvicorn on 127.0.0.1).

The fake (tests/integration/fake_engine.py) generates known tokens with the SmolLM2 tokenizer, so
every expected text, token count and logprob below is computed from the fake's rules, not copied
from the server's output.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from vllm_neuron import metrics
from vllm_neuron.entrypoints.openai.api_server import build_app

from tests.integration.fake_engine import FakeEngine, serve_app
from tests.model_factory import smollm2_tokenizer_dir

MODEL = "smol"
ALIAS = "smol-alias"


@pytest.fixture(scope="module")
def tokenizer():
    # The bundled GGUF's tokenizer, saved once per test cache (reading it from the GGUF takes seconds each time).
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir())


@contextlib.contextmanager
def serve(app):
    with serve_app(app, log_level="warning") as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def engine(tokenizer):
    return FakeEngine(tokenizer, max_model_len=256)


@pytest.fixture(scope="module")
def base_url(engine):
    with serve(build_app(engine, served_model_names=[MODEL, ALIAS], api_key=None, chat_template=None)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="EMPTY", max_retries=0)


def last_call(engine):
    return list(engine.calls.values())[-1]


def chat_prompt_ids(tokenizer, messages, **kw):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return tokenizer.encode(text, add_special_tokens=False)


def sse_events(resp) -> list[str]:
    return [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def metric_value(base_url, name, **labels):
    text = httpx.get(base_url + "/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- the official client ----------------------------------------------------------------------

def test_completion_and_chat_non_streaming(client, engine, tokenizer):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, temperature=0)
    want = engine.expected_ids(6)
    assert r.choices[0].text == tokenizer.decode(want)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode("Hello there"))
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert r.model == MODEL and r.id.startswith("cmpl-") and r.object == "text_completion"

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=ALIAS, messages=messages, max_completion_tokens=4, temperature=0)
    assert r.model == ALIAS and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == tokenizer.decode(engine.expected_ids(4))
    ids = chat_prompt_ids(tokenizer, messages)
    call = last_call(engine)
    assert call.prompt_ids == ids and r.usage.prompt_tokens == len(ids)
    # The template writes BOS itself; the server must not add a second one.
    assert call.prompt_ids[0] == tokenizer.bos_token_id and call.prompt_ids[1] != tokenizer.bos_token_id
    assert call.params.max_tokens == 4


def test_streaming_with_usage(client, engine, tokenizer, base_url):
    want = tokenizer.decode(engine.expected_ids(8))
    chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    messages = [{"role": "user", "content": "Hello"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(chat_prompt_ids(tokenizer, messages))
    assert chunks[-1].usage.completion_tokens == 8

    with httpx.stream("POST", base_url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": messages, "max_tokens": 3, "stream": True}) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"


def test_priority_reaches_the_engine(client, engine):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"priority": -3})
    assert last_call(engine).priority == -3
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                   extra_body={"priority": 7})
    assert last_call(engine).priority == 7


def test_n_choices(client, engine, tokenizer):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, n=2, temperature=1.0, seed=3)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.text == tokenizer.decode(engine.expected_ids(5, seed=3, index=c.index))
    assert r.choices[0].text != r.choices[1].text and r.usage.completion_tokens == 10
    assert last_call(engine).params.seed == 3 and last_call(engine).params.n == 2

    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 max_tokens=4, n=2, temperature=0.7, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == {j: tokenizer.decode(engine.expected_ids(4, index=j)) for j in (0, 1)}


def test_logprobs_both_endpoints(client, engine, tokenizer):
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=5, logprobs=3)
    lp = r.choices[0].logprobs
    ids = engine.expected_ids(5)
    assert lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs == pytest.approx([engine.logprob_of(k, 1) for k in range(5)])
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(5)]
    for k, top in enumerate(lp.top_logprobs):
        assert len(top) == 3 and top[lp.tokens[k]] == pytest.approx(lp.token_logprobs[k])
    assert last_call(engine).params.logprobs == 3

    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in engine.expected_ids(4)]
    for k, c in enumerate(content):
        assert c.logprob == pytest.approx(engine.logprob_of(k, 1)) and c.bytes == list(c.token.encode())
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([engine.logprob_of(k, 1), engine.logprob_of(k, 2)])

    # logprobs=true alone: the sampled token's logprob, no alternatives.
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                       logprobs=True, stream=True)
    entries = [e for c in r for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert len(entries) == 3 and all(e.top_logprobs == [] for e in entries)
    assert last_call(engine).params.logprobs == 0


def test_stop_strings_and_sampling_fields(client, engine, tokenizer):
    full = tokenizer.decode(engine.expected_ids(12))
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=12, stop=["fox"])
    assert r.choices[0].text == full[:full.index("fox")]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == "fox"
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=12, stop="fox",
        extra_body={"include_stop_str_in_output": True, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
                    "min_tokens": 2, "ignore_eos": True, "skip_special_tokens": False, "stop_token_ids": [2],
                    "logit_bias": {"42": 500}})
    assert r.choices[0].message.content == full[:full.index("fox") + 3]
    sp = last_call(engine).params
    assert (sp.top_k, sp.min_p, sp.repetition_penalty, sp.min_tokens) == (5, 0.1, 1.2, 2)
    assert sp.ignore_eos and not sp.skip_special_tokens and sp.stop_token_ids == [2]
    assert sp.logit_bias == {42: 100.0}  # clamped like vLLM


def test_max_tokens_defaults_to_remaining_context(client, engine, tokenizer):
    messages = [{"role": "user", "content": "Hello"}]
    before = len(engine.calls)
    client.chat.completions.create(model=MODEL, messages=messages, stream=True).close()
    assert wait_for(lambda: len(engine.calls) > before)
    assert last_call(engine).params.max_tokens == 256 - len(chat_prompt_ids(tokenizer, messages))
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7)
    assert last_call(engine).params.max_tokens == 7


def test_generation_config_defaults_fill_unset_fields(tokenizer):
    """--generation-config: the defaults fill fields a chat request leaves unset, max_tokens included
    (capped by the rest of the context); a request's own values win."""
    eng = FakeEngine(tokenizer, max_model_len=256)
    eng.model_info.sampling_defaults = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 40}
    with serve(build_app(eng, served_model_names=[MODEL])) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}])
        sp = last_call(eng).params
        assert (sp.temperature, sp.top_p, sp.max_tokens, sp.top_k) == (0.2, 0.9, 40, 0)
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], temperature=0.0,
                                  max_tokens=300 - 256 + 5)
        sp = last_call(eng).params
        assert (sp.temperature, sp.max_tokens) == (0.0, 49)
        c.completions.create(model=MODEL, prompt="Hi")  # vLLM's completions default stays 16
        assert last_call(eng).params.max_tokens == 16


def test_echo_and_multiple_prompts(client, engine, tokenizer):
    r = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=3, echo=True)
    assert r.choices[0].text == "Say hi" + tokenizer.decode(engine.expected_ids(3))
    assert r.choices[0].logprobs is None
    r = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=0, echo=True)
    assert r.choices[0].text == "Say hi"
    r = client.completions.create(model=MODEL, prompt=["a", "bb"], max_tokens=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.prompt_tokens == len(tokenizer.encode("a")) + len(tokenizer.encode("bb"))


# ---- errors -----------------------------------------------------------------------------------

LONG = "word " * 240
CHAT = [{"role": "user", "content": "hi"}]

ERROR_CASES = [
    # (endpoint, body, status, type, param)
    ("completions", {"model": "nope", "prompt": "x"}, 404, "NotFoundError", "model"),
    ("completions", {"prompt": "x", "temperature": "hot"}, 400, "BadRequestError", "temperature"),
    ("completions", {"prompt": "x", "top_p": 5}, 400, "BadRequestError", "top_p"),
    ("completions", {"prompt": "x", "logprobs": 21}, 400, "BadRequestError", "logprobs"),
    ("completions", {"prompt": "x", "n": 2, "temperature": 0}, 400, "BadRequestError", "n"),
    ("completions", {"prompt": "x", "best_of": 3}, 400, "BadRequestError", "best_of"),
    ("completions", {"prompt": "x", "suffix": "end"}, 400, "BadRequestError", "suffix"),
    ("completions", {"prompt": "x", "stop_token_ids": [10 ** 7]}, 400, "BadRequestError", "stop_token_ids"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "BadRequestError",
     "stream_options"),
    ("completions", {"prompt": ""}, 400, "BadRequestError", "prompt"),
    # Prompt logprobs above the server's --max-logprobs (20), and max_tokens 0 without echo (nothing to score).
    ("completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "BadRequestError", "prompt_logprobs"),
    ("completions", {"prompt": "x", "echo": True, "logprobs": 21, "max_tokens": 0}, 400, "BadRequestError",
     "logprobs"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "BadRequestError", "max_tokens"),
    # A server without --enable-prompt-embeds; chat never takes them (vLLM's rule).
    ("completions", {"prompt_embeds": "AAAA"}, 400, "BadRequestError", "prompt_embeds"),
    ("chat/completions", {"messages": CHAT, "prompt_embeds": "AAAA"}, 400, "BadRequestError", "prompt_embeds"),
    ("chat/completions", {"messages": CHAT, "prompt_logprobs": 21}, 400, "BadRequestError", "prompt_logprobs"),
    ("completions", {"prompt": "[[invalid]]"}, 400, "BadRequestError", None),
    ("completions", {"prompt": "[[dead]]"}, 500, "InternalServerError", None),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 21, "logprobs": True}, 400, "BadRequestError",
     "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "BadRequestError", "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "BadRequestError", "tools"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema"}}, 400, "BadRequestError",
     "response_format"),
    ("chat/completions", {"messages": CHAT, "guided_json": {"type": "object", "uniqueItems": True}}, 400,
     "BadRequestError", "guided_json"),
    ("chat/completions", {"messages": CHAT, "structured_outputs": {"regex": "(a+"}}, 400, "BadRequestError",
     "structured_outputs"),
    # Refused before rendering: request templates need --trust-request-chat-template.
    ("chat/completions", {"messages": CHAT, "chat_template": "{% for %}"}, 400, "BadRequestError", "chat_template"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "BadRequestError", "messages[0].content[0].type"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "BadRequestError",
     "max_completion_tokens"),
]


@pytest.mark.parametrize("endpoint,body,status,etype,param", ERROR_CASES,
                         ids=[f"{c[0]}-{'-'.join(c[1])}-{c[2]}" for c in ERROR_CASES])
def test_error_cases(base_url, endpoint, body, status, etype, param):
    r = httpx.post(f"{base_url}/v1/{endpoint}", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == etype and err["code"] == status and err["param"] == param and err["message"]


def test_context_length_and_malformed_json(base_url, tokenizer):
    n_prompt = len(tokenizer.encode(LONG))
    r = httpx.post(base_url + "/v1/completions", json={"prompt": LONG, "max_tokens": 100})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        f"This model's maximum context length is 256 tokens. However, you requested {n_prompt + 100} tokens "
        f"({n_prompt} in the messages, 100 in the completion). Please reduce the length of the messages or "
        "completion.")
    long_chat = [{"role": "user", "content": LONG + LONG}]
    r = httpx.post(base_url + "/v1/chat/completions", json={"messages": long_chat})
    assert r.status_code == 400 and "maximum context length is 256 tokens" in r.json()["error"]["message"]
    r = httpx.post(base_url + "/v1/chat/completions", content=b'{"messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    # Harmless fields are accepted; the server keeps serving after every error above.
    r = httpx.post(base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "user": "u", "foo": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["text"]


def test_engine_death_mid_stream(base_url, engine):
    with httpx.stream("POST", base_url + "/v1/completions",
                      json={"prompt": "[[dead-mid]]", "max_tokens": 20, "stream": True}) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 500 and err["type"] == "InternalServerError"
    assert len(events) == 4  # two chunks, the error, [DONE]
    assert httpx.post(base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


# ---- other endpoints --------------------------------------------------------------------------

def test_models_endpoint(client, base_url):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, ALIAS]
    raw = httpx.get(base_url + "/v1/models").json()
    card = raw["data"][0]
    assert raw["object"] == "list" and card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["root"] == "/models/SmolLM2-135M-Instruct.Q4_1.gguf" and card["max_model_len"] == 256
    assert card["permission"][0]["object"] == "model_permission" and isinstance(card["created"], int)
    assert httpx.get(base_url + "/version").json()["version"]


def test_tokenize_detokenize(base_url, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    body = {"model": MODEL, "messages": messages, "return_token_strs": True}
    r = httpx.post(base_url + "/tokenize", json=body).json()
    assert r["tokens"] == chat_prompt_ids(tokenizer, messages)
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 256
    assert r["tokens"].count(tokenizer.bos_token_id) == 3  # one <|im_start|> per turn, none added
    assert r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
    no_gen = httpx.post(base_url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert r["tokens"][:no_gen["count"]] == no_gen["tokens"] and no_gen["count"] < r["count"]
    r = httpx.post(base_url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tokenizer.encode("Hello world") and "token_strs" not in r
    r = httpx.post(base_url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert r == {"prompt": "Hello world"}
    r = httpx.post(base_url + "/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_api_key(engine):
    app = build_app(engine, served_model_names=[MODEL], api_key="sk-test")
    with serve(app) as url:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test"}):
            r = httpx.get(url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
            r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401
        good = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].text
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200


def _health_codes(url: str) -> list[int]:
    """/health, and vLLM's /ping by GET and POST, which answer the same."""
    return [httpx.get(url + "/health").status_code, httpx.get(url + "/ping").status_code,
            httpx.post(url + "/ping").status_code]


def test_health_follows_engine_state(tokenizer):
    fake = FakeEngine(tokenizer, ready=False)
    with serve(build_app(fake, served_model_names=[MODEL], api_key="sk-test")) as url:
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        assert "graphs" not in r.json()["error"]["message"]  # before the engine says how far it got
        fake.warmed_up = (3, 8)
        assert "in progress (3 of 8 graphs)" in httpx.get(url + "/health").json()["error"]["message"]
        assert _health_codes(url) == [503] * 3
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sk-test"})
        assert r.status_code == 503
        fake.ready = True
        assert _health_codes(url) == [200] * 3  # open without the key, as in vLLM
        fake.dead = True
        assert _health_codes(url) == [503] * 3
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer sk-test"})
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"


def test_metrics(base_url, client):
    series = [("vllm:request_success_total", {"finished_reason": "length"}),
              ("vllm:time_to_first_token_seconds_count", {}), ("vllm:generation_tokens_total", {}),
              ("vllm:prompt_tokens_total", {})]
    before = [metric_value(base_url, name, model_name=MODEL, **labels) for name, labels in series]
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    after = [metric_value(base_url, name, model_name=MODEL, **labels) for name, labels in series]
    n_prompt = httpx.post(base_url + "/tokenize", json={"prompt": "Hi"}).json()["count"]
    assert [a - b for a, b in zip(after, before)] == [1, 1, 4, n_prompt]
    # Another process (as an engine or worker would) writes into the same multiprocess folder.
    code = ("import vllm_neuron.metrics as m; m.configure('smol', rank_id=1); "
            "m.record_compilation_time('decode_b8', 1.5); m.record_model_load(0.7, 1234); "
            "m.record_startup_time(3.0); m.record_async_sync_fallback()")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics.MULTIPROC_DIR}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    text = httpx.get(base_url + "/metrics").text
    for name in metrics.SERIES_NAMES:
        assert f"\n{name}" in text, name
    assert metric_value(base_url, "vllm_neuron:compilation_time_seconds", bucket_name="decode_b8", rank_id="1") == 1.5
    assert metric_value(base_url, "vllm_neuron:model_load_size_bytes", rank_id="1") == 1234
    assert metric_value(base_url, "vllm_neuron:neff_execution_count_total", bucket_name="prefill_s256") > 0


# ---- disconnects ------------------------------------------------------------------------------

def test_stream_disconnect_aborts(base_url, engine):
    with httpx.stream("POST", base_url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "[[slow]]"}], "max_tokens": 200,
                            "stream": True}) as resp:
        got = []
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"role"' not in line:
                got.append(line)
                break
        # Other requests are served while the slow one streams.
        assert httpx.post(base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    call = [c for c in engine.calls.values() if "[[slow]]" in (c.prompt_text or "")][-1]
    assert got and not call.finished
    assert wait_for(lambda: call.request_id in engine.aborted), "abort was not called after disconnect"
    # Other requests are served while and after the slow one went away.
    assert httpx.post(base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_non_streaming_disconnect_aborts(base_url, engine):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json={"prompt": "[[slow]]", "max_tokens": 200}, timeout=0.5)
    call = last_call(engine)
    assert wait_for(lambda: call.request_id in engine.aborted), "abort was not called after disconnect"
    assert wait_for(lambda: call.cancelled) and not call.finished


@pytest.mark.parametrize("path,body", [("/v1/embeddings", {"input": "hi"}), ("/pooling", {"input": "hi"}),
                                       ("/classify", {"input": "hi"}), ("/score", {"text_1": "a", "text_2": "b"}),
                                       ("/v1/rerank", {"query": "a", "documents": ["b"]})])
def test_pooling_routes_refuse_a_generative_model(base_url, path, body):
    r = httpx.post(base_url + path, json={"model": MODEL, **body}, timeout=10)
    assert r.status_code == 400, r.text
    assert "generative model" in r.json()["error"]["message"]


def test_responses_without_a_store(client, engine, base_url):
    """/v1/responses on any chat model; without --enable-store nothing is kept, and saying so."""
    res = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4)
    assert res.store is False and [i.type for i in res.output] == ["message"] and res.output_text
    assert res.usage.output_tokens == 4 and last_call(engine).params.max_tokens == 4
    assert httpx.get(f"{base_url}/v1/responses/{res.id}").status_code == 404
    with pytest.raises(openai.NotFoundError, match="--enable-store"):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=res.id)
