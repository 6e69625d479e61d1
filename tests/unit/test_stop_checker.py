"""check_stop: token-level stop conditions and their order."""
import pytest

from vllm_neuron.core.stop_checker import check_stop
from vllm_neuron.sampling_params import SamplingParams

EOS = 2


def stop(out, max_model_len=100, num_prompt=10, eos=EOS, **kw):
    return check_stop(out, SamplingParams(**kw), eos, num_prompt, max_model_len)


def test_running_request_does_not_stop():
    assert stop([5, 6, 7]) is None
    assert stop([]) is None


def test_eos_stops_without_stop_reason():
    assert stop([5, EOS]) == ("stop", None)
    # Only the newest token counts.
    assert stop([EOS, 5]) is None


def test_ignore_eos():
    assert stop([5, EOS], ignore_eos=True) is None
    # ignore_eos does not disable an explicit stop token id, even the EOS id.
    assert stop([5, EOS], ignore_eos=True, stop_token_ids=[EOS]) == ("stop", EOS)


def test_no_eos_known():
    assert stop([5, EOS], eos=None) is None


def test_stop_token_id_reports_it():
    assert stop([5, 9], stop_token_ids=[8, 9]) == ("stop", 9)


def test_max_tokens():
    assert stop([5] * 3, max_tokens=4) is None
    assert stop([5] * 4, max_tokens=4) == ("length", None)
    assert stop([5] * 50, max_tokens=None) is None


def test_max_model_len():
    assert stop([5] * 5, num_prompt=10, max_model_len=16, max_tokens=None) is None
    assert stop([5] * 6, num_prompt=10, max_model_len=16, max_tokens=None) == ("length", None)


def test_min_tokens_gates_eos_and_stop_ids_only():
    assert stop([5, EOS], min_tokens=3) is None
    assert stop([5, 9], min_tokens=3, stop_token_ids=[9]) is None
    assert stop([5, 6, EOS], min_tokens=3) == ("stop", None)
    assert stop([5, 6, 9], min_tokens=3, stop_token_ids=[9]) == ("stop", 9)
    # The context limit still applies while min_tokens is unmet.
    assert stop([5, 6], min_tokens=5, max_tokens=8, num_prompt=10, max_model_len=12) == ("length", None)


@pytest.mark.parametrize("last, expected", [
    (EOS, ("stop", None)),  # EOS beats the length cap on the same token
    (9, ("stop", 9)),       # so does a stop token id
    (5, ("length", None)),
])
def test_order_stop_before_length(last, expected):
    assert stop([5, 5, last], max_tokens=3, stop_token_ids=[9]) == expected
    assert stop([5, 5, last], num_prompt=7, max_model_len=10, stop_token_ids=[9],
                max_tokens=None) == expected


def test_eos_before_stop_token_id():
    # EOS also listed in stop_token_ids: EOS is checked first, so stop_reason stays None.
    assert stop([5, EOS], stop_token_ids=[EOS]) == ("stop", None)
