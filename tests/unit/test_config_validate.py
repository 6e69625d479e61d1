"""config/validate.py: the option checks shared by EngineArgs, neuron_config, speculative_config and the bucket
lists; every error names the option and what is valid."""
from __future__ import annotations

import pytest

from vllm_neuron.config import validate as V


@pytest.mark.parametrize("kwargs, value, message", [
    ({"minimum": 1}, 0, "opt must be a positive integer, got 0"),
    ({"minimum": 0}, -1, "opt must be a non-negative integer, got -1"),
    ({"minimum": 2}, 1, "opt must be an integer >= 2, got 1"),
    ({"maximum": 3}, 4, "opt must be an integer <= 3, got 4"),
    ({"minimum": 0, "maximum": 3, "context": "n=4"}, 4, r"opt must be an integer in \[0, 3\] \(n=4\), got 4"),
    ({}, True, "opt must be an integer, got True"),
    ({}, 1.0, "opt must be an integer, got 1.0"),
    ({}, "3", "opt must be an integer, got '3'"),
    ({"from_text": True}, "x", "opt must be an integer, got 'x'"),
])
def test_integer_refusals(kwargs, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        V.integer("opt", value, **kwargs)


def test_integer_accepts_and_returns():
    assert V.integer("opt", 3, minimum=1, maximum=3) == 3
    assert V.integer("opt", " 7 ", from_text=True) == 7  # neuron_config's quoted numbers
    assert V.optional_integer("opt", None, minimum=1) is None
    with pytest.raises(ValueError, match="opt must be a positive integer"):
        V.optional_integer("opt", 0, minimum=1)


@pytest.mark.parametrize("kwargs, value, message", [
    ({"minimum": 0.0, "maximum": 1.0, "min_exclusive": True}, 0, r"opt must be in \(0, 1\], got 0"),
    ({"minimum": 0.0, "maximum": 1.0}, 1.5, r"opt must be in \[0, 1\], got 1.5"),
    ({"minimum": 0.0}, -0.5, "opt must be >= 0, got -0.5"),
    ({"minimum": 0.0, "min_exclusive": True}, 0.0, "opt must be > 0, got 0"),
    ({"maximum": 2.0}, 3, "opt must be <= 2, got 3"),
    ({}, "0.5", "opt must be a number, got '0.5'"),
    ({}, float("nan"), "opt must be a number, got nan"),
    ({}, False, "opt must be a number, got False"),
])
def test_number_refusals(kwargs, value, message):
    with pytest.raises(ValueError, match=f"^{message}$"):
        V.number("opt", value, **kwargs)


def test_number_accepts_text_where_allowed():
    assert V.number("opt", "0.7", from_text=True, minimum=0.0) == 0.7
    assert V.number("opt", 1, minimum=0.0, maximum=1.0, min_exclusive=True) == 1.0


def test_boolean_choice_port_host_and_not_supported():
    assert V.boolean("opt", False) is False and V.boolean("opt", None, allow_none=True) is None
    with pytest.raises(ValueError, match="^opt must be true or false, got 1$"):
        V.boolean("opt", 1)
    with pytest.raises(ValueError, match="^opt must be true, false or unset, got 'yes'$"):
        V.boolean("opt", "yes", allow_none=True)
    assert V.choice("opt", "b", ("a", "b")) == "b"
    with pytest.raises(ValueError, match=r"^opt='c' is not valid; valid values: \['a', 'b'\]$"):
        V.choice("opt", "c", ("a", "b"))
    assert V.port("opt", 8000) == 8000
    for bad in (0, 65536, "80", True):
        with pytest.raises(ValueError, match=r"^opt must be a TCP port in \[1, 65535\]"):
            V.port("opt", bad)
    assert V.host("opt", "10.0.0.1") == "10.0.0.1"
    with pytest.raises(ValueError, match="^opt must be a host name or IP address, got ''$"):
        V.host("opt", "")
    assert str(V.not_supported("opt", 2, "why")) == "opt=2 is not supported yet by vllm-neuron: why"


@pytest.mark.parametrize("kwargs, match", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer, got 0"),
    ({"max_num_seqs": "8"}, "max_num_seqs must be a positive integer, got '8'"),
    ({"seed": 1.5}, "seed must be an integer, got 1.5"),
    ({"enforce_eager": "no"}, "enforce_eager must be true or false, got 'no'"),
    ({"master_port": 0}, r"master_port must be a TCP port in \[1, 65535\]"),
    ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be in \(0, 1\], got 0"),
    ({"additional_config": {"neuron_config": {"on_device_sampling_config": {"top_p": 2}}}},
     r"on_device_sampling_config.top_p must be in \(0, 1\], got 2"),
    ({"additional_config": {"encoder_neuron_config": {"encoder_cache_min_hold_time_ms": -1}}},
     "encoder_cache_min_hold_time_ms must be >= 0, got -1"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}},
     r"speculative_config.num_speculative_tokens must be an integer in \[1, 16\], got 0"),
])
def test_engine_options_use_the_shared_checks(kwargs, match):
    from vllm_neuron.config.engine_args import EngineArgs

    with pytest.raises(ValueError, match=match):
        EngineArgs.from_kwargs(**kwargs)
