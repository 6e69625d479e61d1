"""--speculative-config: vLLM's JSON, defaults, and clear errors; its interaction rules with the rest of
the configuration (runner selection, async scheduling, on-device sampling)."""
from __future__ import annotations

import argparse

import pytest

from vllm_neuron.config.arg_utils import add_engine_args, engine_args_from_cli
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.engine_config import ModelFacts, resolve
from vllm_neuron.config.speculative import SpeculativeConfig, check_draft_compatible, parse_speculative_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_ngram_defaults_follow_vllm():
    assert parse_speculative_config(NGRAM) == SpeculativeConfig("ngram", 3, None, 5, 5)
    assert parse_speculative_config({**NGRAM, "prompt_lookup_max": 4}).prompt_lookup_min == 4
    c = parse_speculative_config({**NGRAM, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert parse_speculative_config('{"model": "[ngram]", "num_speculative_tokens": 2}').method == "ngram"
    assert parse_speculative_config(None) is None and parse_speculative_config({}) is None
    assert parse_speculative_config({**NGRAM, "disable_by_batch_size": 4}).disable_by_batch_size == 4
    assert parse_speculative_config(NGRAM).disable_by_batch_size is None


@pytest.mark.parametrize("value, match", [
    ({"method": "medusa", "num_speculative_tokens": 2}, r"method='medusa' is not valid; valid values: \['ngram', 'eagle3', 'dflash'\]"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({**NGRAM, "num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in \[1, 16\], got 0"),
    ({**NGRAM, "num_speculative_tokens": 17}, r"in \[1, 16\], got 17"),
    ({**NGRAM, "num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer"),
    ({**NGRAM, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min must be a positive integer, got 0"),
    ({**NGRAM, "model": "/some/draft"}, "'ngram' uses no draft model"),
    ({"method": "eagle3", "num_speculative_tokens": 3}, "model is required for method 'eagle3'"),
    ({"method": "eagle3", "model": "d", "num_speculative_tokens": 3, "prompt_lookup_min": 2}, "ngram' only"),
    ({**NGRAM, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size is not supported yet"),
    ({**NGRAM, "disable_by_batch_size": 1}, "disable_by_batch_size must be an integer >= 2, got 1"),
    ({**NGRAM, "disable_by_batch_size": "8"}, "disable_by_batch_size must be an integer"),
    ({**NGRAM, "bogus": 1}, r"unknown speculative_config field\(s\) \['bogus'\]"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_values_name_the_option(value, match):
    with pytest.raises(ValueError, match=match):
        parse_speculative_config(value)


def test_draft_compatibility():
    spec = SpeculativeConfig("eagle3", 3, "/d")
    check_draft_compatible(spec, target_vocab=100, target_hidden=64, draft_vocab=32, draft_hidden=32,
                           draft_target_hidden=64)
    with pytest.raises(ValueError, match="draft vocabulary \\(200\\) is larger than the target's \\(100\\)"):
        check_draft_compatible(spec, target_vocab=100, target_hidden=64, draft_vocab=200, draft_hidden=64)
    with pytest.raises(ValueError, match="draft expects target hidden size 48, the target has 64"):
        check_draft_compatible(spec, target_vocab=100, target_hidden=64, draft_vocab=100, draft_hidden=48)


def test_cli_flag_and_kwarg_mean_the_same():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    cli = engine_args_from_cli(p.parse_args(["--speculative-config", '{"method": "ngram", '
                                              '"num_speculative_tokens": 3, "prompt_lookup_max": 4}']))
    kw = EngineArgs.from_kwargs(speculative_config={**NGRAM, "prompt_lookup_max": 4})
    assert cli.speculative_config == kw.speculative_config == SpeculativeConfig("ngram", 3, None, 4, 4)
    resolved = resolve(kw, ModelFacts(2048))
    assert resolved.speculative == kw.speculative_config and resolved.num_speculative_tokens == 3
    assert resolve(EngineArgs.from_kwargs(), ModelFacts(2048)).num_speculative_tokens == 0


def test_interaction_rules(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    c = resolve(EngineArgs.from_kwargs(speculative_config=NGRAM), ModelFacts(2048))
    assert not c.use_v2_model_runner
    assert c.runner_choice.log_message() == "Neuron Model Runner V2 does not yet support speculative decoding; using V1."
    assert c.async_scheduling is False and "speculative decoding" in c.async_scheduling_reason
    # Refused where the options enter (no model needed).
    with pytest.raises(ValueError, match="async_scheduling=True is not supported with speculative decoding"):
        EngineArgs.from_kwargs(speculative_config=NGRAM, async_scheduling=True)
    with pytest.raises(ValueError, match="speculative decoding requires on-device sampling"):
        EngineArgs.from_kwargs(speculative_config=NGRAM, additional_config={
            "neuron_config": {"on_device_sampling_config": None}})
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER=1 cannot serve speculative decoding"):
        resolve(EngineArgs.from_kwargs(speculative_config=NGRAM), ModelFacts(2048))
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    # A multimodal model speculates with n-grams; a draft model needs hidden states its text tower does not give.
    assert resolve(EngineArgs.from_kwargs(speculative_config=NGRAM), ModelFacts(2048, multimodal=True)).speculative
    with pytest.raises(ValueError, match="with a multimodal model.*use method 'ngram'"):
        resolve(EngineArgs.from_kwargs(speculative_config={"method": "eagle3", "model": "/nonexistent",
                                                           "num_speculative_tokens": 2}),
                ModelFacts(2048, multimodal=True))
