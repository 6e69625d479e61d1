"""SamplingParams: vLLM defaults, normalization, validation, derived properties, outputs."""
import copy

import pytest

from vllm_neuron.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from vllm_neuron.sampling_params import RequestOutputKind, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.max_tokens == 16 and p.min_tokens == 0 and p.seed is None
    assert p.stop == [] and p.stop_token_ids == [] and p.bad_words == []
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.skip_special_tokens and p.detokenize and p.spaces_between_special_tokens
    assert p.output_kind is RequestOutputKind.CUMULATIVE
    assert not p.needs_host_sampling


def test_normalization():
    p = SamplingParams(stop="###", stop_token_ids=[5, 7, 5], logit_bias={"12": 3, 4: -1.5},
                       seed=-1, logprobs=True, bad_words=["x", "x", "y"])
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 7]
    assert p.logit_bias == {12: 3.0, 4: -1.5}
    assert p.seed is None
    assert p.logprobs == 1
    assert p.bad_words == ["x", "y"]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={"abc": 1.0})


def test_greedy_resets_truncation():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.3)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    with pytest.raises(ValueError, match="n must be 1 when using greedy"):
        SamplingParams(temperature=0, n=2)


def test_tiny_temperature_is_raised_not_greedy():
    p = SamplingParams(temperature=1e-3)
    assert p.temperature == pytest.approx(1e-2)


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -2}, "logprobs"),
    ({"prompt_logprobs": -3}, "prompt_logprobs"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": "x", "detokenize": False}, "stop"),
    ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
])
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_valid_edge_values():
    SamplingParams(top_k=-1, top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0,
                   max_tokens=None, min_tokens=3, logprobs=-1, prompt_logprobs=0, temperature=2.0)
    SamplingParams(min_tokens=4, max_tokens=4)


def test_verify_against_vocab():
    SamplingParams(stop_token_ids=[9], logprobs=5).verify(vocab_size=10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[10]).verify(vocab_size=10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0}).verify(vocab_size=10)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[3, 12]).verify(vocab_size=10)
    with pytest.raises(ValueError, match="logprobs of 21"):
        SamplingParams(logprobs=21).verify(vocab_size=100, max_logprobs=20)
    SamplingParams(logprobs=-1).verify(vocab_size=100)  # offline: the whole vocabulary is fine
    with pytest.raises(ValueError, match="prompt logprobs"):
        SamplingParams(prompt_logprobs=-1).verify(vocab_size=100, max_logprobs=20)


@pytest.mark.parametrize("kwargs, host", [
    ({"temperature": 0.7, "top_k": 50, "top_p": 0.9, "seed": 1}, False),
    ({"min_p": 0.1}, True),
    ({"presence_penalty": 0.5}, True),
    ({"frequency_penalty": -0.5}, True),
    ({"repetition_penalty": 1.2}, True),
    ({"logit_bias": {1: 2.0}}, True),
    ({"allowed_token_ids": [1, 2]}, True),
    ({"bad_words": ["x"]}, True),
    ({"min_tokens": 2}, True),
    ({"logprobs": 0}, True),
])
def test_needs_host_sampling(kwargs, host):
    assert SamplingParams(**kwargs).needs_host_sampling is host


def test_clone_is_deep():
    p = SamplingParams(stop=["ab", "abcd"], logit_bias={1: 1.0})
    c = p.clone()
    c.stop.append("zz")
    c.logit_bias[2] = 1.0
    assert p.stop == ["ab", "abcd"] and p.logit_bias == {1: 1.0}


def test_outputs_shapes():
    c = CompletionOutput(index=0, text="hi", token_ids=[1, 2], cumulative_logprob=-1.0,
                         logprobs=[{1: Logprob(-0.5, 1, "h")}, {2: Logprob(-0.5, 2, "i")}])
    assert not c.finished()
    c2 = copy.copy(c)
    c2.finish_reason = "stop"
    assert c2.finished()
    r = RequestOutput("r1", "p", [3], None, [c2], finished=True, metrics=RequestMetrics(arrival_time=1.0))
    text = repr(r)
    assert "r1" in text and "'hi'" in text and "finish_reason=stop" in text



@pytest.mark.parametrize("bias", [float("nan"), float("inf"), float("-inf")])
def test_logit_bias_must_be_finite(bias):
    with pytest.raises(ValueError, match="logit_bias values must be finite"):
        SamplingParams(logit_bias={5: bias})
