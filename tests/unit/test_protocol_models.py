"""Request models: strict JSON types, except that an integral float is an integer (JSON Schema's
"integer" includes 16.0)."""
import pytest
from pydantic import ValidationError

from vllm_neuron.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest

CHAT = [{"role": "user", "content": "hi"}]


def test_integral_floats_are_integers():
    req = CompletionRequest(prompt="x", max_tokens=16.0, n=2.0, seed=7.0, stop_token_ids=[3.0])
    assert (req.max_tokens, req.n, req.seed, req.stop_token_ids) == (16, 2, 7, [3])
    assert all(type(v) is int for v in (req.max_tokens, req.n, req.seed, req.stop_token_ids[0]))
    assert ChatCompletionRequest(messages=CHAT, max_completion_tokens=8.0).max_completion_tokens == 8
    assert DetokenizeRequest(tokens=[1.0, 2.0]).tokens == [1, 2]


@pytest.mark.parametrize("field, value", [("max_tokens", 1.5), ("max_tokens", True), ("n", "2"),
                                          ("seed", 2.0 ** 70), ("max_tokens", float("nan"))])
def test_other_wrong_types_still_refused(field, value):
    with pytest.raises(ValidationError) as err:
        CompletionRequest(prompt="x", **{field: value})
    assert field in str(err.value)
