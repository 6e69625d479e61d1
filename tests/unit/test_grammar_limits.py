"""Bounded grammar work: the size limits checked before compiling, the engine manager's compile time limit
and dedup, and the API server's compile process (killed past the time limit, started again after)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.grammar_limits import GrammarLimits
from vllm_neuron.structured_output import GRAMMAR_BUSY, GRAMMAR_INVALID, StructuredOutputsParams
from vllm_neuron.structured_output.limits import check_constraint, longest_token_chars

LIMITS = GrammarLimits(max_properties=10, max_depth=4, max_pattern_length=20, max_repeat=50, max_bytes=4096,
                       compile_timeout_s=1.0, cache_bytes=1 << 20)


def _obj(n: int) -> dict:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(n)}}


def _check(max_tokens=None, **constraint):
    check_constraint(StructuredOutputsParams(**constraint), LIMITS, max_tokens, max_token_chars=10)


def test_within_the_limits_passes():
    _check(json=_obj(10), max_tokens=100)
    _check(json={"type": "string", "maxLength": 10**9, "minLength": 1000}, max_tokens=100)  # maxima are harmless
    _check(regex="[a-z]{0,50}")
    _check(regex=r"\{1000\}")  # an escaped brace is a literal, not a repetition
    _check(grammar='root ::= "a"{1,50}')
    _check(choice=["yes", "no"])


@pytest.mark.parametrize("constraint, needle", [
    ({"json": {"type": "object", "properties": {"a": _obj(6), "b": _obj(6)}}}, "more than 10 object properties"),
    ({"json": {"items": {"items": {"items": {"items": {"type": "string"}}}}}}, "deeper than 4 levels"),
    ({"json": {"anyOf": [{"anyOf": [{"anyOf": [{"anyOf": [{}]}]}]}]}}, "deeper than 4 levels"),
    ({"json": {"type": "string", "pattern": "a" * 21}}, "pattern of 21 characters"),
    ({"json": {"type": "string", "pattern": "[a-z]{0,51}"}}, r"repetition \{0,51\}"),
    ({"json": {"type": "object", "patternProperties": {"^x{99}$": {}}}}, r"repetition \{99\}"),
    ({"regex": "(ab){51,}"}, r"repetition \{51,\}"),
    ({"regex": "a" * 21}, "pattern of 21 characters"),
    ({"grammar": 'root ::= "a"{1,99}'}, r"repetition \{1,99\}"),
    ({"choice": ["x" * 5000]}, "more than this server compiles \\(4096, --grammar-max-bytes\\)"),
    ({"structural_tag": {"structures": [{"begin": "<f>", "schema": _obj(11), "end": "</f>"}],
                         "triggers": ["<f>"]}}, "more than 10 object properties"),
    ({"structural_tag": json.dumps({"format": {"type": "regex", "pattern": "b{60}"}})}, r"repetition \{60\}"),
])
def test_over_the_limits_is_refused(constraint, needle):
    with pytest.raises(ValueError, match=needle) as e:
        _check(**constraint)
    assert str(e.value).startswith("structured_outputs.")  # the serving code maps it to the request field


@pytest.mark.parametrize("schema, needle", [
    ({"type": "string", "minLength": 1001}, "minLength: 1001"),  # 100 tokens write 1000 characters at most
    ({"type": "array", "minItems": 101}, "minItems: 101"),
    ({"type": "object", "minProperties": 101}, "minProperties: 101"),
])
def test_unreachable_minimums_are_refused(schema, needle):
    with pytest.raises(ValueError, match=f"{needle}.*cannot be met within max_tokens=100"):
        _check(json=schema, max_tokens=100)
    _check(json=schema)  # the budget unknown: not checked


def test_options_are_checked_by_name():
    for kwargs, needle in (({"grammar_max_properties": 0}, "grammar_max_properties must be a positive integer"),
                           ({"grammar_compile_timeout": 0}, "grammar_compile_timeout must be > 0"),
                           ({"grammar_cache_bytes": -1}, "grammar_cache_bytes must be a non-negative integer")):
        with pytest.raises(ValueError, match=needle):
            EngineArgs.from_kwargs(**kwargs)
    limits = EngineArgs.from_kwargs(grammar_max_depth=7, grammar_compile_timeout=2.5).grammar_limits
    assert (limits.max_depth, limits.compile_timeout_s) == (7, 2.5)


# ---- the engine's manager ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


def _status(manager, rid, timeout=15.0):
    deadline = time.monotonic() + timeout
    while True:
        ready, error, kind = manager.status(rid)
        if ready or error:
            return ready, error, kind
        assert time.monotonic() < deadline, "no answer from the manager"
        time.sleep(0.01)


def test_manager_fails_a_compilation_past_the_time_limit_and_one_queued_behind_it(tokenizer, monkeypatch):
    from vllm_neuron.structured_output import compiler as C
    from vllm_neuron.structured_output import manager as M

    release = threading.Event()
    calls = []

    def slow_compile(compiler, params):
        calls.append(params.kind)
        release.wait(20)
        raise ValueError("released")

    monkeypatch.setattr(C, "compile_params", slow_compile)
    m = M.StructuredOutputManager(tokenizer, 49152, max_workers=1, compile_timeout_s=0.3)
    try:
        m.submit("a", {"regex": "a+"})
        m.submit("b", {"regex": "a+"})  # the same grammar: joins the compilation
        m.submit("c", {"regex": "b+"})  # another one: queued behind it (one worker)
        ready, error, kind = _status(m, "a")
        assert not ready and "did not compile within 0.3 s" in error and kind == GRAMMAR_INVALID
        assert _status(m, "b")[2] == GRAMMAR_INVALID and calls == ["regex"]
        ready, error, kind = _status(m, "c")  # never started: the worker is held; gives up after 3 limits
        assert not ready and "busy" in error and kind == GRAMMAR_BUSY
        assert m.compile_timeouts == 2
    finally:
        release.set()
        m.shutdown()


def test_manager_threads_compile_at_low_priority(tokenizer, monkeypatch):
    import os

    from vllm_neuron.structured_output import compiler as C
    from vllm_neuron.structured_output import manager as M

    seen = []

    def compile_noting_priority(compiler, params):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        raise ValueError("noted")

    monkeypatch.setattr(C, "compile_params", compile_noting_priority)
    m = M.StructuredOutputManager(tokenizer, 49152, max_workers=1)
    try:
        m.submit("a", {"regex": "a+"})
        _status(m, "a")
        assert seen and seen[0] >= 10  # nice 10 (or more, if the test runs niced already)
    finally:
        m.shutdown()


def test_grammar_cache_is_bounded_in_bytes(tokenizer):
    from vllm_neuron.structured_output.compiler import GrammarCache, make_tokenizer_info, new_compiler

    info = make_tokenizer_info(tokenizer, 49152)
    params = [StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+")]
    size = {p.regex: GrammarCache(new_compiler(info), 1 << 30).get(p).memory_size_bytes for p in params}
    cache = GrammarCache(new_compiler(info), size["b+"] + size["c+"])
    grammars = [cache.get(p) for p in params]
    assert cache.size_bytes <= size["b+"] + size["c+"] and list(cache._grammars) == [p.key() for p in params[1:]]
    assert cache.get(params[2]) is grammars[2]  # kept: the same object
    assert cache.get(params[0]) is not grammars[0]  # "a+" went out first: compiled again
    assert GrammarCache(new_compiler(info), 0).get(params[0]) is not None  # keeps none, still compiles


# ---- the API server's compile process -----------------------------------------------------------------

def test_checker_kills_a_slow_compilation_and_serves_the_next(tokenizer):
    from vllm_neuron.structured_output.checker import GrammarChecker

    limits = GrammarLimits(compile_timeout_s=1.0, max_repeat=2000)
    checker = GrammarChecker(tokenizer, 49152, limits)
    try:
        checker.check(StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}}))
        first = checker.worker_pid
        assert first is not None and checker.cache_bytes > 0
        with open(f"/proc/{first}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[16]) >= 10  # nice 10
        # 40 patterns near the repeat limit pass every size check and compile for several seconds.
        slow = {"type": "object", "required": ["p0"],
                "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z]{{0,{1900 + i}}}"} for i in range(40)}}
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="did not compile within 1 s"):
            checker.check(StructuredOutputsParams(json=slow))
        assert time.monotonic() - t0 < 5 and checker.compile_timeouts == 1
        assert checker.worker_pid is None  # killed
        checker.check(StructuredOutputsParams(regex="[0-9]+"))  # a new process
        assert checker.worker_pid not in (None, first)
        with pytest.raises(ValueError, match="invalid regex"):
            checker.check(StructuredOutputsParams(regex="(unclosed"))
    finally:
        checker.close()


def test_longest_token_chars(tokenizer):
    assert longest_token_chars(tokenizer) == max(len(t) for t in tokenizer.get_vocab())
