"""The HTTP edge's pure checks: request limits, JSON depth, lone surrogates, body parsing."""
from __future__ import annotations

import pytest

from vllm_neuron.entrypoints.openai.errors import BadRequestError
from vllm_neuron.entrypoints.openai.request_body import (
    MAX_JSON_DEPTH,
    json_depth_exceeds,
    parse_json_object,
    replace_lone_surrogates,
)
from vllm_neuron.entrypoints.openai.request_policy import RequestLimits


def test_limits_refuse_bad_configuration():
    with pytest.raises(ValueError, match="--max-n"):
        RequestLimits(max_n=0)
    with pytest.raises(ValueError, match="--max-request-body-bytes"):
        RequestLimits(max_body_bytes=10)


def test_check_n_and_template_trust():
    limits = RequestLimits(max_n=3)
    limits.check_n(None)
    limits.check_n(3)
    for bad in (0, 4):
        with pytest.raises(BadRequestError) as e:
            limits.check_n(bad)
        assert e.value.param == "n"
    limits.check_chat_template(None)
    with pytest.raises(BadRequestError, match="--trust-request-chat-template"):
        limits.check_chat_template("{{ 1 }}")
    RequestLimits(trust_request_chat_template=True).check_chat_template("{{ 1 }}")


def test_json_depth():
    def nest(depth):
        value = 1
        for i in range(depth):
            value = [value] if i % 2 else {"k": value}
        return value

    assert not json_depth_exceeds(nest(MAX_JSON_DEPTH), MAX_JSON_DEPTH)
    assert json_depth_exceeds(nest(MAX_JSON_DEPTH + 1), MAX_JSON_DEPTH)
    assert json_depth_exceeds(nest(50_000), MAX_JSON_DEPTH)  # iterative: no RecursionError


def test_lone_surrogates_replaced_pairs_kept():
    value = {"a\ud800": ["x\udfffy", {"k": "\U0001F600"}], "n": 3}
    assert replace_lone_surrogates(value) == {"a\ufffd": ["x\ufffdy", {"k": "\U0001F600"}], "n": 3}


@pytest.mark.parametrize("raw,needle", [
    (b"{", "Invalid JSON"), (b"[1]", "JSON object"), (b"\xff\xfe", "Invalid JSON"),
    (b"[" * 5000 + b"]" * 5000, "nested deeper"),
    (b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", "nested deeper"),
    # int() refuses literals of more than sys.get_int_max_str_digits() digits with a plain ValueError
    (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "4300 digits"),
    (b'{"logit_bias": {"1": NaN}}', "NaN is not a JSON number"),
    (b'{"temperature": -Infinity}', "-Infinity is not a JSON number"),
])
def test_parse_json_object_errors(raw, needle):
    with pytest.raises(BadRequestError, match=needle):
        parse_json_object(raw)


def test_parse_json_object_replaces_surrogates_only_when_escaped():
    assert parse_json_object(b'{"p": "a\\ud800", "q": "\\ud83d\\ude00"}') == {"p": "a\ufffd", "q": "\U0001F600"}
    assert parse_json_object(b'{"p": "plain"}') == {"p": "plain"}


def test_limits_refuse_bad_body_read_timeout():
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="--body-read-timeout"):
            RequestLimits(body_read_timeout_s=bad)
