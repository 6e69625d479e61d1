"""StructuredOutputsParams, schema/regex/grammar validation, the request-field mapping of the server,
and the StructuredOutputManager's masks (real xgrammar, SmolLM2 tokenizer, no model)."""
from __future__ import annotations

import json
import pickle
import re
import time

import numpy as np
import pytest
from transformers import AutoTokenizer

from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm_neuron.entrypoints.openai.structured import structured_outputs_from_request
from vllm_neuron.sampling_params import SamplingParams
from vllm_neuron.structured_output import GRAMMAR_INVALID, StructuredOutputsParams
from vllm_neuron.structured_output.compiler import make_tokenizer_info, validate
from vllm_neuron.structured_output.manager import StructuredOutputManager

EOS = 2
VOCAB = 49152
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="module")
def info(tokenizer):
    return make_tokenizer_info(tokenizer)


@pytest.fixture(scope="module")
def manager(tokenizer):
    return StructuredOutputManager(tokenizer, VOCAB)


# ---- the parameters ---------------------------------------------------------------------------------

def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="one constraint must be given"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="only one kind of constraint.*json, regex"):
        StructuredOutputsParams(json=PERSON, regex="a+")
    with pytest.raises(ValueError, match="choice must be a non-empty list of strings"):
        StructuredOutputsParams(choice="yes")
    with pytest.raises(ValueError, match="choice must be a non-empty list of strings"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="NUL"):
        StructuredOutputsParams(regex="a\x00b")
    with pytest.raises(ValueError, match="whitespace_pattern is not supported.*disable_any_whitespace"):
        StructuredOutputsParams(json=PERSON, whitespace_pattern=r"[ ]?")
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(choice=("a", "b")).choice == ["a", "b"]


def test_from_dict_and_sampling_params():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['jsn'\]"):
        StructuredOutputsParams.from_value({"jsn": PERSON})
    with pytest.raises(ValueError, match="must be an object"):
        StructuredOutputsParams.from_value("a+")
    sp = SamplingParams(structured_outputs={"regex": "[0-9]+"}, temperature=0.7)
    assert isinstance(sp.structured_outputs, StructuredOutputsParams) and sp.structured_outputs.regex == "[0-9]+"
    # The mask is applied inside the graph: a grammar alone never forces host sampling.
    assert not sp.needs_host_sampling
    # The engine process receives requests pickled; n > 1 children are dataclasses.replace copies.
    again = pickle.loads(pickle.dumps(sp))
    assert again.structured_outputs == sp.structured_outputs
    assert sp.clone().structured_outputs == sp.structured_outputs
    with pytest.raises(ValueError, match="only one kind"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})


def test_key_separates_grammars():
    a = StructuredOutputsParams(json=PERSON)
    assert a.key() == StructuredOutputsParams(json=json.loads(json.dumps(PERSON))).key()
    assert a.key() != StructuredOutputsParams(json=PERSON, disable_any_whitespace=True).key()
    assert StructuredOutputsParams(regex="a").key() != StructuredOutputsParams(grammar="a").key()


# ---- validation: compiled against the tokenizer ---------------------------------------------------------

@pytest.mark.parametrize("params", [
    StructuredOutputsParams(json=PERSON),
    StructuredOutputsParams(json=json.dumps(PERSON)),
    StructuredOutputsParams(json={"type": "integer", "multipleOf": 3}),
    StructuredOutputsParams(json={"$defs": {"n": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"}),
    StructuredOutputsParams(json={"type": "string", "format": "date"}),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"\d{3}-[a-z]+"),
    StructuredOutputsParams(choice=['say "hi"', "back\\slash", "ünï"]),
    StructuredOutputsParams(grammar='root ::= "(" num ("," num)* ")"\nnum ::= [0-9]+'),
    StructuredOutputsParams(grammar='start: "yes" | "no"'),  # Lark
    StructuredOutputsParams(structural_tag={"structures": [{"begin": "<f>", "schema": PERSON, "end": "</f>"}],
                                            "triggers": ["<f>"]}),
], ids=["schema", "schema-text", "int-multipleOf", "recursive-ref", "format-date", "json-object", "regex",
        "choice", "ebnf", "lark", "structural-tag"])
def test_valid_constraints_compile(params, info):
    validate(params, info)


@pytest.mark.parametrize("params,needle", [
    (StructuredOutputsParams(json="{not json"), "structured_outputs.json is not valid JSON"),
    (StructuredOutputsParams(json={"type": "foo"}), 'invalid JSON schema: Unsupported type "foo"'),
    (StructuredOutputsParams(json={"$ref": "#/defs/x"}), "invalid JSON schema"),
    (StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     "`uniqueItems` at #"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
     "`not` at #/properties/a"),
    (StructuredOutputsParams(json={"type": "object", "if": {}, "then": {}}), "`if` at #"),
    (StructuredOutputsParams(json={"type": "number", "multipleOf": 0.5}), "`multipleOf` on a non-integer type"),
    (StructuredOutputsParams(json={"type": "string", "format": "idn-email"}), "string format 'idn-email'"),
    (StructuredOutputsParams(json={"type": "string", "pattern": "a+", "maxLength": 3}),
     "`minLength`/`maxLength` together with `pattern`"),
    (StructuredOutputsParams(json={"allOf": [{"type": "object"}, {"required": ["a"]}]}),
     "`allOf` with more than one subschema"),
    (StructuredOutputsParams(json={"type": "array", "items": {"anyOf": [{"type": "string"}, {
        "type": "object", "dependentRequired": {"a": ["b"]}}]}}), "`dependentRequired` at #/items/anyOf/1"),
    (StructuredOutputsParams(regex="(abc"), "structured_outputs.regex: invalid regex"),
    (StructuredOutputsParams(regex="(?=a)b"), "Lookahead is not supported"),
    (StructuredOutputsParams(grammar="root ::= foo"), 'invalid EBNF grammar: .*Rule "foo" is not defined'),
    (StructuredOutputsParams(grammar='start ::= "a"'), 'root rule with name "root" is not found'),
    (StructuredOutputsParams(structural_tag="{"), "structural_tag is not valid JSON"),
    (StructuredOutputsParams(structural_tag={"structures": [{"begin": "<f>"}], "triggers": ["<f>"]}),
     "needs begin, schema and end"),
], ids=lambda v: v if isinstance(v, str) else v.kind)
def test_invalid_or_unenforceable_constraints_are_refused(params, needle, info):
    with pytest.raises(ValueError) as e:
        validate(params, info)
    assert re.search(needle, str(e.value)), str(e.value)
    assert "/project/cpp" not in str(e.value)  # no C++ source locations in user-facing messages


def test_repeat_compile_is_cached(info):
    schema = {"type": "object", "properties": {f"k{i}": {"type": "string", "format": "email"} for i in range(8)}}
    params = StructuredOutputsParams(json=schema)
    t0 = time.perf_counter()
    validate(params, info)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(5):
        validate(StructuredOutputsParams(json=json.loads(json.dumps(schema))), info)
    assert (time.perf_counter() - t0) / 5 < first / 3, "a repeated schema should not be compiled again"


# ---- the server's request fields -----------------------------------------------------------------------

def _chat(**fields):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **fields})


def test_request_fields_map_to_one_constraint():
    so, param = structured_outputs_from_request(_chat(response_format={
        "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}))
    assert so.json == PERSON and param == "response_format"
    so, param = structured_outputs_from_request(_chat(response_format={"type": "json_object"}))
    assert so.json_object is True
    assert structured_outputs_from_request(_chat(response_format={"type": "text"})) == (None, None)
    so, param = structured_outputs_from_request(CompletionRequest(prompt="x", guided_choice=["a", "b"]))
    assert so.choice == ["a", "b"] and param == "guided_choice"
    so, _ = structured_outputs_from_request(_chat(guided_regex="a+", guided_json=None))
    assert so.regex == "a+"
    so, _ = structured_outputs_from_request(_chat(guided_grammar='root ::= "a"'))
    assert so.grammar == 'root ::= "a"'
    # Options of `structured_outputs` apply to a constraint given elsewhere.
    so, param = structured_outputs_from_request(_chat(
        structured_outputs={"disable_any_whitespace": True},
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}))
    assert so.json == PERSON and so.disable_any_whitespace and param == "response_format"
    assert structured_outputs_from_request(_chat()) == (None, None)


@pytest.mark.parametrize("fields,param,needle", [
    ({"guided_json": PERSON, "structured_outputs": {"json": PERSON}}, "guided_json", "both set `json`"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "only one kind of constraint"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "valid types: text, json_object"),
    ({"guided_whitespace_pattern": " ", "guided_json": PERSON}, "guided_whitespace_pattern",
     "whitespace_pattern is not supported"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "structured_outputs", "one constraint must be"),
])
def test_request_field_errors(fields, param, needle):
    with pytest.raises(BadRequestError) as e:
        structured_outputs_from_request(_chat(**fields))
    assert e.value.param == param and needle in str(e.value), (e.value.param, str(e.value))


# ---- the manager: masks and matcher state ------------------------------------------------------------

def _allowed(mask: np.ndarray) -> set[int]:
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return set(np.nonzero(bits)[0].tolist())


def _wait_ready(manager, rid, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        ready, error, _ = manager.status(rid)
        if ready or error:
            return ready, error
        assert time.monotonic() < deadline, "grammar compilation did not finish"
        time.sleep(0.002)


def test_manager_mask_follows_the_grammar(manager, tokenizer):
    manager.submit("r1", StructuredOutputsParams(choice=["yes", "no"]))
    assert _wait_ready(manager, "r1") == (True, None) and manager.has("r1")
    mask = manager.bitmask("r1")
    assert mask.dtype == np.int32 and mask.shape == (VOCAB // 32,)
    first = _allowed(mask)
    texts = {t: tokenizer.decode([t]) for t in first}
    # Every allowed token starts one of the choices; EOS is not allowed before the answer is complete.
    assert first and EOS not in first
    assert all(("yes".startswith(s) or "no".startswith(s)) and s for s in texts.values()), texts
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in first
    for t in tokenizer.encode("no", add_special_tokens=False):
        manager.accept("r1", [t])
    # Complete: only EOS may follow.
    assert _allowed(manager.bitmask("r1")) == {EOS}
    manager.accept("r1", [EOS])
    # After the grammar's end (ignore_eos keeps a request going) only EOS stays allowed.
    assert _allowed(manager.bitmask("r1")) == {EOS}
    manager.remove("r1")
    assert not manager.has("r1")


def test_manager_json_mask_and_shared_compilation(manager, tokenizer):
    for rid in ("a", "b"):
        manager.submit(rid, StructuredOutputsParams.from_value({"json": PERSON, "disable_any_whitespace": True}))
    # One compilation for both (joined while it runs, or the compiler's cache after it).
    assert manager._pending["a"] is manager._pending["b"] or manager.cache_bytes > 0
    assert _wait_ready(manager, "a") == (True, None) and _wait_ready(manager, "b") == (True, None)
    assert manager.cache_bytes > 0
    # Feed a valid answer token by token; each token must have been allowed by the mask before it.
    answer = tokenizer.encode('{"name": "Ann", "age": 42}', add_special_tokens=False)
    for t in answer:
        assert t in _allowed(manager.bitmask("a")), tokenizer.decode([t])
        manager.accept("a", [t])
    assert _allowed(manager.bitmask("a")) == {EOS}
    # The other request's matcher is its own: still at the start, where '{' is required.
    start = _allowed(manager.bitmask("b"))
    assert all(tokenizer.decode([t]).startswith("{") for t in start) and EOS not in start
    manager.remove("a")
    manager.remove("b")


def test_manager_reports_compile_errors(manager):
    manager.submit("bad", {"regex": "(unclosed"})
    ready, error = _wait_ready(manager, "bad")
    assert not ready and "invalid regex" in error
    manager.submit("bad2", {"json": PERSON, "regex": "a"})
    ready, error, kind = manager.status("bad2")
    assert not ready and "only one kind" in error and kind == GRAMMAR_INVALID
    assert not manager.has("bad") and not manager.has("bad2")


# ---- closing within the token budget ----------------------------------------------------------------

CALL = {"type": "array", "minItems": 1, "items": {
    "type": "object", "properties": {"name": {"enum": ["search"]},
                                     "parameters": {"type": "object", "properties": {
                                         "query": {"type": "string"}, "n": {"type": "integer"}},
                                         "required": ["query"]}},
    "required": ["name", "parameters"]}}


def _random_walk(manager, tokenizer, rid: str, seed: int, budget: int, close: bool) -> tuple[str, bool]:
    """Samples uniformly among the allowed tokens (no stop token unless it is the only one): a model with
    no wish to finish. Returns the text and whether it ended with the stop token within `budget`."""
    rng = np.random.default_rng(seed)
    manager.submit(rid, StructuredOutputsParams(json=CALL, disable_any_whitespace=True))
    assert _wait_ready(manager, rid) == (True, None)
    ids = []
    try:
        for i in range(budget):
            allowed = _allowed(manager.bitmask(rid, budget - i if close else None))
            choices = sorted(allowed - {EOS}) or [EOS]
            t = int(rng.choice(choices))
            if t == EOS:
                return tokenizer.decode(ids), True
            manager.accept(rid, [t])
            ids.append(t)
        return tokenizer.decode(ids), False
    finally:
        manager.remove(rid)


def test_budget_closes_free_strings_arrays_and_numbers(manager, tokenizer):
    """Free strings, unbounded arrays and integers never end by themselves under a model that does not want
    them to; with the budget every output closes in time, parses and follows the schema."""
    budget = 48
    unclosed = 0
    for seed in range(6):
        text, ended = _random_walk(manager, tokenizer, f"open{seed}", seed, budget, close=False)
        unclosed += not ended
        text, ended = _random_walk(manager, tokenizer, f"close{seed}", seed, budget, close=True)
        assert ended, text
        calls = json.loads(text)
        assert calls and all(c["name"] == "search" and isinstance(c["parameters"]["query"], str) for c in calls)
    assert unclosed >= 4  # the walk is a fair adversary: without the budget it runs out


def test_budget_never_forbids_what_fits(manager, tokenizer):
    """Far from the end the mask is exactly the grammar's; an answer fitting its budget (plus the reserve of
    one opened item) is allowed token by token."""
    answer = tokenizer.encode('[{"name": "search", "parameters": {"query": "weather in Paris today", "n": 3}}]',
                              add_special_tokens=False)
    manager.submit("fit", StructuredOutputsParams(json=CALL, disable_any_whitespace=True))
    assert _wait_ready(manager, "fit") == (True, None)
    assert (manager.bitmask("fit", 10_000) == manager.bitmask("fit")).all()
    budget = len(answer) + 1 + manager._plans["fit"].reserve
    for i, t in enumerate(answer):
        assert t in _allowed(manager.bitmask("fit", budget - i)), (i, tokenizer.decode(answer[:i + 1]))
        manager.accept("fit", [t])
    assert _allowed(manager.bitmask("fit", budget - len(answer))) == {EOS}
    manager.remove("fit")
