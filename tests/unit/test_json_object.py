"""config/json_object.parse_json_object: the JSON-object options' shared parsing, each with its own words."""
from __future__ import annotations

import pytest

from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.generation_config import parse_override
from vllm_neuron.config.json_object import parse_json_object
from vllm_neuron.config.neuron_config import parse_additional_config
from vllm_neuron.config.speculative import parse_speculative_config

NOT_JSON = "opt is not valid JSON ({value!r}): {error}"
NOT_OBJECT = "opt must be a JSON object, got {type}: {value!r}"


def test_objects_text_and_none():
    assert parse_json_object(None, NOT_JSON, NOT_OBJECT) == {}
    assert parse_json_object('{"a": [1, 2]}', NOT_JSON, NOT_OBJECT) == {"a": [1, 2]}
    given = {"b": 1}
    parsed = parse_json_object(given, NOT_JSON, NOT_OBJECT)
    assert parsed == given and parsed is not given  # a copy: the caller's dict is never changed


@pytest.mark.parametrize("value, message", [
    ("{a: 1}", r"^opt is not valid JSON \('\{a: 1\}'\): Expecting property name"),
    ("", r"^opt is not valid JSON \(''\): Expecting value"),
    ("[1, 2]", r"^opt must be a JSON object, got list: \[1, 2\]$"),
    (3, r"^opt must be a JSON object, got int: 3$"),
])
def test_refusals_use_the_callers_message(value, message):
    with pytest.raises(ValueError, match=message):
        parse_json_object(value, NOT_JSON, NOT_OBJECT)


@pytest.mark.parametrize("parse, message", [
    (parse_override, r"^override_generation_config must be a JSON object, got list$"),
    (parse_speculative_config, r"^speculative_config must be a JSON object, got list$"),
    (parse_additional_config, r"^--additional-config must be a JSON object, got \[1\]$"),
    (lambda v: EngineArgs.from_kwargs(mm_processor_kwargs=v), r"^mm_processor_kwargs must be a JSON object, got \[1\]$"),
])
def test_each_option_names_itself(parse, message):
    with pytest.raises(ValueError, match=message):
        parse("[1]")
    with pytest.raises(ValueError, match="JSON"):
        parse("{")
