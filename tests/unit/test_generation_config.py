"""--generation-config / --override-generation-config: which defaults requests get (pure)."""
from __future__ import annotations

import json

import pytest

from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.generation_config import (effective_generation_config, parse_override,
                                                  sampling_defaults)
from vllm_neuron.model.loader.checkpoint import BUNDLED_GENERATION_CONFIG

MODEL = {"eos_token_id": 2, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 100}


def test_auto_takes_the_models_sampling_keys():
    gen = effective_generation_config("auto", MODEL)
    assert sampling_defaults(gen) == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 100}


def test_vllm_keeps_token_ids_but_not_sampling():
    gen = effective_generation_config("vllm", MODEL)
    assert gen == {"eos_token_id": 2} and sampling_defaults(gen) == {}


def test_folder_and_override(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 20, "temperature": 0.7}))
    gen = effective_generation_config(str(tmp_path), MODEL, parse_override('{"temperature": 0.1}'))
    assert sampling_defaults(gen) == {"top_k": 20, "temperature": 0.1}
    assert gen["eos_token_id"] == 2


@pytest.mark.parametrize("kwargs, match", [
    ({"generation_config": "/no/such/folder"}, "generation_config='/no/such/folder' is not valid"),
    ({"override_generation_config": '{"temprature": 1}'}, "temprature"),
    ({"override_generation_config": "[1]"}, "must be a JSON object"),
])
def test_refusals_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs.from_kwargs(**kwargs)


def test_bundled_config_is_the_model_cards_sampling():
    with open(BUNDLED_GENERATION_CONFIG) as f:
        data = json.load(f)
    assert sampling_defaults(data) == {"temperature": 0.2, "top_p": 0.9, "max_tokens": 256}
    assert "model card" in data["_source"]
