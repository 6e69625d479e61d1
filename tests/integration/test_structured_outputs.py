"""Structured outputs and tool calling end to end on a tiny random-weight Llama.

Random weights make these real tests: unconstrained, the model writes garbage (checked below), so an
answer that parses and validates every time, over several seeds and at temperature 1, shows the grammar
mask at work. Validity is checked by an independent validator and by `re.fullmatch`, never by xgrammar.
Offline (both samplers, constrained and unconstrained requests in the same steps), then over HTTP on a
real `serve` process, then auto tool calling over a canned engine.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from vllm_neuron import LLM, SamplingParams
from vllm_neuron.structured_output import StructuredOutputsParams

pytestmark = pytest.mark.engine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOST_SAMPLING = {"neuron_config": {"on_device_sampling_config": None}}
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                   "vip": {"type": "boolean"}},
                  "required": ["name", "vip"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1,
                 "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 2},
        "note": {"type": "string", "maxLength": 4},
    },
    "required": ["id", "kind", "owner", "tags", "scores"],
}
PET = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 20},
                                       "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
       "required": ["kind", "age", "tags"]}
REGEX = r"(cat|dog)-[0-9]{2,4}"
CHOICES = ["alpha", "beta gamma", "δέλτα"]
GRAMMAR = 'root ::= "(" num ("," num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'
GRAMMAR_RE = r"\([1-9][0-9]{0,2}(,[1-9][0-9]{0,2}){0,3}\)"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}


def conforms(schema: dict, value) -> bool:
    """An independent JSON-schema check for the keywords used here."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and all(k in props and conforms(props[k], v) for k, v in value.items()))
    if kind == "array":
        return (isinstance(value, list) and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30)
                and all(conforms(schema["items"], v) for v in value))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", -1 << 60) <= value <= schema.get("maximum", 1 << 60))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None


def parses_and_conforms(text: str, schema: dict) -> bool:
    try:
        return conforms(schema, json.loads(text))
    except json.JSONDecodeError:
        return False


# ---- offline ----------------------------------------------------------------------------------------

def _requests():
    """(sampling params, check) pairs: constrained requests of every kind, sampled and greedy. JSON with
    any whitespace uses the small PET schema: a random model spends many tokens on whitespace."""
    so = StructuredOutputsParams
    reqs = [(SamplingParams(temperature=1.0, seed=s, max_tokens=300,
                            structured_outputs=so(json=SCHEMA, disable_any_whitespace=True)),
             lambda t: parses_and_conforms(t, SCHEMA) and not re.search(r"\s", t.replace(" ", "")))
            for s in range(2)]
    reqs += [
        (SamplingParams(temperature=0.0, max_tokens=300,
                        structured_outputs=so(json=json.dumps(SCHEMA), disable_any_whitespace=True)),
         lambda t: parses_and_conforms(t, SCHEMA)),
        (SamplingParams(temperature=1.0, seed=2, max_tokens=300, structured_outputs=so(json=PET)),
         lambda t: parses_and_conforms(t, PET)),
        (SamplingParams(temperature=1.0, seed=3, max_tokens=40, structured_outputs=so(regex=REGEX)),
         lambda t: re.fullmatch(REGEX, t) is not None),
        (SamplingParams(temperature=1.0, seed=4, max_tokens=40, structured_outputs=so(choice=CHOICES)),
         lambda t: t in CHOICES),
        (SamplingParams(temperature=0.8, seed=5, max_tokens=60, structured_outputs=so(grammar=GRAMMAR)),
         lambda t: re.fullmatch(GRAMMAR_RE, t) is not None),
    ]
    return reqs


@pytest.fixture(scope="module")
def tiny_path(tiny_llama_dir):
    return tiny_llama_dir


@pytest.mark.parametrize("sampler", ["on-device", "host"])
def test_constrained_outputs_are_valid_in_a_mixed_batch(tiny_path, sampler):
    extra = {} if sampler == "on-device" else {"additional_config": HOST_SAMPLING}
    # fp32: the unconstrained row is compared across batch sizes (bf16 kernels round per row count).
    llm = LLM(tiny_path, enforce_eager=True, dtype="float32", max_model_len=512, num_gpu_blocks_override=128,
              max_num_seqs=8, **extra)
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reqs = _requests()
    params = [p for p, _ in reqs] + [plain]
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    for (p, check), out in zip(reqs, outs[:len(reqs)], strict=True):
        c = out.outputs[0]
        assert check(c.text), f"{p.structured_outputs.kind}: {c.text!r}"
        # The grammar completed and allowed EOS only then: the request stopped on it, not on max_tokens.
        assert c.finish_reason == "stop" and c.stop_reason is None, (c.finish_reason, c.text)
    seeded = [outs[i].outputs[0].text for i in range(2)]
    assert len(set(seeded)) > 1, "temperature 1 with different seeds should give different valid answers"
    # Unconstrained rows of the same steps: garbage (so the mask is what made the others valid) and
    # untouched by the other rows' masks (the same tokens as when run alone).
    batched = outs[len(reqs)].outputs[0]
    assert not parses_and_conforms(batched.text, SCHEMA)
    alone = llm.generate(["Answer in JSON:"], plain, use_tqdm=False)[0].outputs[0]
    assert batched.token_ids == alone.token_ids


def test_offline_errors(tiny_path):
    llm = LLM(tiny_path, enforce_eager=True, max_model_len=256, num_gpu_blocks_override=32, max_num_seqs=2)
    with pytest.raises(ValueError, match="`uniqueItems` at #/properties/tags"):
        llm.generate("x", SamplingParams(structured_outputs={"json": {"type": "object", "properties": {
            "tags": {"type": "array", "uniqueItems": True}}}}), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.regex: invalid regex"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")), use_tqdm=False)
    # The engine still serves after refusing.
    out = llm.generate("x", SamplingParams(max_tokens=8, temperature=0.0,
                                           structured_outputs={"choice": ["yes", "no"]}), use_tqdm=False)
    assert out[0].outputs[0].text in ("yes", "no")


# ---- a real server ------------------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _serve_process(args: list[str], tmp):
    """A real `serve` process on a free port; yields (url, served model id)."""
    port = _free_port()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PROMETHEUS_MULTIPROC_DIR=str(tmp))
    log = open(tmp / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "vllm_neuron.entrypoints.cli.main", "serve", *args,
                             "--port", str(port)], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, (tmp / "server.log").read_text()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server not healthy:\n" + (tmp / "server.log").read_text()
            time.sleep(0.2)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        yield url, model
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    with _serve_process([tiny_path, "--enforce-eager", "--max-model-len", "512", "--num-gpu-blocks-override", "128",
                         "--max-num-seqs", "8", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                        tmp_path_factory.mktemp("so_server")) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="EMPTY", max_retries=0, timeout=120)


MSGS = [{"role": "user", "content": "Describe a pet as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _stream_chat(client, model, **kw):
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model, messages=MSGS, stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert call["id"] is None and tc.type == "function"
                call["id"], call["name"] = tc.id, tc.function.name
            else:
                assert call["id"] is not None, "arguments before the call's id and name"
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.finish_reason or finish
    return content, calls, finish


def _check_call(name: str, arguments: str) -> None:
    schema = {"get_weather": WEATHER, "get_time": CLOCK}[name]["function"]["parameters"]
    assert parses_and_conforms(arguments, schema), (name, arguments)


def test_server_structured_outputs_and_tool_calls(server, client):
    """All requests at once (the server batches them), then each answer is checked."""
    _, model = server
    chat = client.chat.completions.create
    tools = [WEATHER, CLOCK]
    jobs = {
        "schema-1": lambda: chat(model=model, messages=MSGS, response_format=RESPONSE_FORMAT, temperature=1.0,
                                 seed=1, max_tokens=300),
        "schema-greedy": lambda: chat(model=model, messages=MSGS, response_format=RESPONSE_FORMAT, temperature=0.0,
                                      max_tokens=300),
        "schema-stream": lambda: _stream_chat(client, model, response_format=RESPONSE_FORMAT, temperature=1.0,
                                              seed=3, max_tokens=300),
        "json-object": lambda: chat(model=model, messages=MSGS, response_format={"type": "json_object"}, seed=4,
                                    max_tokens=30),
        "guided-choice": lambda: client.completions.create(model=model, prompt="Pick:", max_tokens=20, seed=5,
                                                           extra_body={"guided_choice": CHOICES}),
        "guided-regex-stream": lambda: "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt="Code:", max_tokens=20, seed=6, stream=True, extra_body={"guided_regex": REGEX})
            if c.choices),
        "grammar": lambda: client.completions.create(model=model, prompt="Tuple:", max_tokens=40, seed=7,
                                                     extra_body={"structured_outputs": {"grammar": GRAMMAR}}),
        "required": lambda: chat(model=model, messages=MSGS, tools=tools, tool_choice="required", seed=1,
                                 max_tokens=400),
        "required-stream": lambda: _stream_chat(client, model, tools=tools, tool_choice="required", seed=2,
                                                max_tokens=400, parallel_tool_calls=False),
        "named": lambda: chat(model=model, messages=MSGS, tools=tools, tool_choice=NAMED, seed=3, max_tokens=200),
        "named-stream": lambda: _stream_chat(client, model, tools=tools, tool_choice=NAMED, seed=4, max_tokens=200),
        "none": lambda: chat(model=model, messages=MSGS, tools=[WEATHER], tool_choice="none", max_tokens=8),
        "auto": lambda: chat(model=model, messages=MSGS, tools=[WEATHER], max_tokens=8),
    }
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        res = {name: f.result() for name, f in futures.items()}

    for name in ("schema-1", "schema-greedy"):
        choice = res[name].choices[0]
        assert parses_and_conforms(choice.message.content, PET) and choice.finish_reason == "stop", choice
    content, calls, finish = res["schema-stream"]
    assert parses_and_conforms(content, PET) and finish == "stop" and not calls, content
    # Any JSON object: it opens with "{", and it parses whenever it was not cut by max_tokens.
    choice = res["json-object"].choices[0]
    assert choice.message.content.startswith("{"), choice.message.content
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    assert res["guided-choice"].choices[0].text in CHOICES
    assert re.fullmatch(REGEX, res["guided-regex-stream"]), res["guided-regex-stream"]
    assert re.fullmatch(GRAMMAR_RE, res["grammar"].choices[0].text), res["grammar"].choices[0].text

    choice = res["required"].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    assert not choice.message.content
    for tc in choice.message.tool_calls:
        assert tc.type == "function" and tc.id.startswith("chatcmpl-tool-")
        _check_call(tc.function.name, tc.function.arguments)
    content, calls, finish = res["required-stream"]
    assert finish == "tool_calls" and content == "" and list(calls) == [0], (content, calls)
    _check_call(calls[0]["name"], calls[0]["arguments"])
    choice = res["named"].choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name == "get_weather"
    _check_call("get_weather", choice.message.tool_calls[0].function.arguments)
    content, calls, finish = res["named-stream"]
    assert finish == "tool_calls" and list(calls) == [0] and calls[0]["name"] == "get_weather" and not content
    _check_call("get_weather", calls[0]["arguments"])
    # "none": a plain answer even with tools; "auto" (the default with tools; served here) answers without
    # calls when the model (random weights) writes none.
    for name in ("none", "auto"):
        choice = res[name].choices[0]
        assert not choice.message.tool_calls and choice.finish_reason == "length" and choice.message.content


@pytest.mark.parametrize("path,body,param,needle", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}},
     "response_format", 'invalid JSON schema: Unsupported type "wat"'),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}},
     "response_format", "feature that cannot be enforced: `uniqueItems`"),
    ("/v1/completions", {"prompt": "x", "guided_regex": "(ab"}, "guided_regex", "invalid regex"),
    ("/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= nothing"}},
     "structured_outputs", 'Rule "nothing" is not defined'),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", "Tool 'f' has not been passed"),
    ("/v1/chat/completions", {"tools": [WEATHER], "tool_choice": "required", "guided_json": SCHEMA},
     "guided_json", "cannot be combined"),
], ids=["invalid-schema", "unsupported-feature", "bad-regex", "bad-grammar", "unknown-tool", "tools+schema"])
def test_server_errors(server, path, body, param, needle):
    url, model = server
    if path.endswith("chat/completions"):
        body = {"messages": MSGS, **body}
    for stream in (False, True):  # refused before a stream starts, too
        r = httpx.post(url + path, json={"model": model, "stream": stream, **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "BadRequestError" and err["param"] == param and needle in err["message"], err


# ---- the bundled model at temperature 1 ----------------------------------------------------------------

# Free strings and an unbounded integer: what a real model can run on without end.
FREE_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "max_results": {"type": "integer"}},
        "required": ["query"]}}},
]
FREE_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in FREE_TOOLS}


@pytest.fixture(scope="module")
def bundled_server(tmp_path_factory):
    with _serve_process(["--enforce-eager", "--max-model-len", "1024", "--num-gpu-blocks-override", "96",
                         "--max-num-seqs", "8"], tmp_path_factory.mktemp("bundled_server")) as served:
        yield served


def test_bundled_model_finishes_tool_calls_at_temperature_1(bundled_server):
    """SmolLM2 sampled at temperature 1 (top_p 1) loops on call items, digits and prose inside strings:
    without the budget, 4 of 16 such calls (max_tokens 200) ran to the end without closing. Every call
    must now close within max_tokens, parse and follow its function's schema."""
    url, model = bundled_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    jobs = [("required", s) for s in range(4)] + [("named", s) for s in range(4)]

    def run(job):
        mode, seed = job
        return client.chat.completions.create(model=model, messages=msgs, tools=FREE_TOOLS, seed=seed,
                                              tool_choice=named if mode == "named" else "required",
                                              temperature=1.0, top_p=1.0, max_tokens=96)

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(run, jobs))
    for (mode, seed), r in zip(jobs, results):
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, (mode, seed, choice)
        assert r.usage.completion_tokens <= 96
        for tc in choice.message.tool_calls:
            assert mode == "required" or tc.function.name == "get_weather"
            assert parses_and_conforms(tc.function.arguments, FREE_SCHEMAS[tc.function.name]), (mode, seed, tc)


# ---- auto tool choice over a canned engine ----------------------------------------------------------------

HERMES = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
          '</tool_call>')


@pytest.fixture(scope="module")
def canned(smollm2_tokenizer_dir):
    from tests.integration.fake_engine import FakeEngine
    from tests.integration.test_openai_fake_engine import serve
    from vllm_neuron.entrypoints.openai.api_server import build_app

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    engine = FakeEngine(tok, max_model_len=512)
    engine.script_ids = tok.encode(HERMES, add_special_tokens=False) + [tok.eos_token_id]
    with serve(build_app(engine, served_model_names=["m"], enable_auto_tool_choice=True,
                         tool_call_parser="hermes")) as with_parser, \
            serve(build_app(engine, served_model_names=["m"])) as without:
        yield with_parser, without, tok.eos_token_id


def test_auto_tool_choice_with_parser(canned):
    url, _, eos = canned
    client = openai.OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
    kw = dict(model="m", messages=MSGS, tools=[WEATHER], max_tokens=200, extra_body={"stop_token_ids": [eos]})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "I will check.\n"
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in msg.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": 2})]
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": None, "arguments": ""})
            call["name"] = call["name"] or (tc.function.name if tc.function else None)
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = ch.finish_reason or finish
    assert content == "I will check.\n" and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Oslo", "days": 2}


def test_auto_tool_choice_without_parser_is_400(canned):
    _, url, _ = canned
    for body in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": MSGS, **body})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "--enable-auto-tool-choice" in msg and "--tool-call-parser" in msg
