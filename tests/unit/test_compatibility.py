"""Which model runner a configuration gets (VLLM_USE_V2_MODEL_RUNNER), and the seeds' log lines."""
from __future__ import annotations

import pytest

from vllm_neuron import envs
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.config.runner_selection import (V2_LOG_LINE, RunnerChoice, mrv2_unsupported_features,
                                                 select_model_runner)

CPU = "CPU sampling (on_device_sampling_config=null)"
EAGER = "eager execution (enforce_eager)"
CPU_SAMPLING = {"neuron_config": {"on_device_sampling_config": None}}


@pytest.mark.parametrize("raw, value", [(None, None), ("", None), ("0", False), ("1", True), (" 1 ", True)])
def test_env_values(monkeypatch, raw, value):
    if raw is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", raw)
    assert envs.VLLM_USE_V2_MODEL_RUNNER is value


@pytest.mark.parametrize("raw", ["2", "true", "yes", "v2"])
def test_invalid_env_value_names_the_variable_and_valid_values(monkeypatch, raw):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", raw)
    with pytest.raises(ValueError, match=r"VLLM_USE_V2_MODEL_RUNNER=.*valid values: unset .* 0 .* 1 "):
        _ = envs.VLLM_USE_V2_MODEL_RUNNER


def test_unsupported_features_list():
    assert mrv2_unsupported_features(cpu_sampling=False, enforce_eager=False) == ()
    assert mrv2_unsupported_features(cpu_sampling=True, enforce_eager=False) == (CPU,)
    assert mrv2_unsupported_features(cpu_sampling=False, enforce_eager=True) == (EAGER,)
    assert mrv2_unsupported_features(cpu_sampling=True, enforce_eager=True) == (CPU, EAGER)


def test_unset_picks_v2_only_for_supported_configurations():
    supported = select_model_runner(None, cpu_sampling=False, enforce_eager=False)
    assert supported == RunnerChoice(True, (), None) and supported.log_message() is None
    eager = select_model_runner(None, cpu_sampling=False, enforce_eager=True)
    assert not eager.use_v2
    assert eager.log_message() == f"Neuron Model Runner V2 does not yet support {EAGER}; using V1."
    both = select_model_runner(None, cpu_sampling=True, enforce_eager=True)
    assert not both.use_v2
    assert both.log_message() == f"Neuron Model Runner V2 does not yet support {CPU}, {EAGER}; using V1."


def test_zero_forces_v1_silently():
    for cpu, eager in ((False, False), (True, True)):
        choice = select_model_runner(False, cpu_sampling=cpu, enforce_eager=eager)
        assert not choice.use_v2 and choice.log_message() is None


def test_one_forces_v2_and_warns_only_about_unsupported_features():
    assert select_model_runner(True, cpu_sampling=False, enforce_eager=False).log_message() is None
    forced = select_model_runner(True, cpu_sampling=True, enforce_eager=True)
    assert forced.use_v2 and forced.forced is True
    assert forced.log_message() == (f"VLLM_USE_V2_MODEL_RUNNER=1 forces Neuron Model Runner V2 with unsupported "
                                    f"features ({CPU}, {EAGER}); execution may fail.")


@pytest.mark.parametrize("model", [dict(moe=True), dict(sliding_window=True), dict(moe=True, sliding_window=True)])
def test_moe_and_sliding_window_models_use_v1_without_a_log_line_unless_forced(model):
    # Seeds: "MoE, sliding-window ... models use MRv1 without a log message"; forced to MRv2 they start
    # without the warning (it names only the configuration's unsupported features).
    for cpu, eager in ((False, False), (True, True)):
        choice = select_model_runner(None, cpu_sampling=cpu, enforce_eager=eager, **model)
        assert not choice.use_v2 and choice.log_message() is None
    forced = select_model_runner(True, cpu_sampling=False, enforce_eager=False, **model)
    assert forced.use_v2 and forced.log_message() is None
    forced_eager = select_model_runner(True, cpu_sampling=False, enforce_eager=True, **model)
    assert forced_eager.log_message() == (f"VLLM_USE_V2_MODEL_RUNNER=1 forces Neuron Model Runner V2 with "
                                          f"unsupported features ({EAGER}); execution may fail.")


def test_v2_log_line_is_the_seeds():
    assert V2_LOG_LINE == "Using the standalone V2 Neuron model runner."


@pytest.mark.parametrize("raw, kwargs, expected", [
    (None, {}, True),
    (None, {"enforce_eager": True}, False),
    (None, {"additional_config": CPU_SAMPLING}, False),
    ("0", {}, False),
    ("1", {"enforce_eager": True}, True),
    ("1", {"additional_config": CPU_SAMPLING}, True),
])
def test_engine_config_resolves_use_v2_model_runner(monkeypatch, raw, kwargs, expected):
    if raw is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", raw)
    config = EngineConfig.from_kwargs(max_model_len=256, **kwargs)
    assert config.use_v2_model_runner is False  # nothing resolved before finalize()
    config.finalize(model_max_len=2048)
    assert config.use_v2_model_runner is expected
    assert config.runner_choice.forced == (None if raw is None else raw == "1")


@pytest.mark.parametrize("model, kind", [(dict(moe=True), "MoE"), (dict(sliding_window=True), "sliding-window"),
                                         (dict(moe=True, sliding_window=True), "MoE, sliding-window")])
def test_mrv1_model_reason_says_why_but_is_not_the_seeds_line(model, kind):
    choice = select_model_runner(None, cpu_sampling=False, enforce_eager=False, **model)
    assert choice.model_reason().startswith(f"Model Runner V1: {kind} models use MRv1 by default")
    assert "does not yet support" not in choice.model_reason()
    # Forced either way, or a dense model: the choice needs no explanation.
    assert select_model_runner(False, cpu_sampling=False, enforce_eager=False, **model).model_reason() is None
    assert select_model_runner(True, cpu_sampling=False, enforce_eager=False, **model).model_reason() is None
    assert select_model_runner(None, cpu_sampling=False, enforce_eager=True).model_reason() is None
