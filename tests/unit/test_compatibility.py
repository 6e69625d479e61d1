"""Which model runner a configuration gets (VLLM_USE_V2_MODEL_RUNNER, the seeds' log lines) and which
combinations of features are refused: config/compatibility.py, the one place that decides both."""
from __future__ import annotations

import pytest

from vllm_neuron import envs
from vllm_neuron.config import compatibility as C
from vllm_neuron.config.compatibility import V2_LOG_LINE, Features, RunnerChoice, check, select_runner
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.config.engine_config import ModelFacts, resolve

CPU = "CPU sampling (on_device_sampling_config=null)"
EAGER = "eager execution (enforce_eager)"
CPU_SAMPLING = {"neuron_config": {"on_device_sampling_config": None}}
DENSE = dict(moe=False, sliding_window=False, multimodal=False)


def _select(env, *, cpu_sampling=False, enforce_eager=False, **model) -> RunnerChoice:
    return select_runner(Features(**{**DENSE, **model}, cpu_sampling=cpu_sampling, enforce_eager=enforce_eager), env)


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
    assert _select(None).unsupported == ()
    assert _select(None, cpu_sampling=True).unsupported == (CPU,)
    assert _select(None, enforce_eager=True).unsupported == (EAGER,)
    assert _select(None, cpu_sampling=True, enforce_eager=True).unsupported == (CPU, EAGER)
    spec = select_runner(Features(**DENSE, speculative="ngram"), None)
    assert spec.unsupported == ("speculative decoding",)


def test_unset_picks_v2_only_for_supported_configurations():
    supported = _select(None)
    assert supported == RunnerChoice(True, (), None) and supported.log_message() is None
    eager = _select(None, enforce_eager=True)
    assert not eager.use_v2
    assert eager.log_message() == f"Neuron Model Runner V2 does not yet support {EAGER}; using V1."
    both = _select(None, cpu_sampling=True, enforce_eager=True)
    assert not both.use_v2
    assert both.log_message() == f"Neuron Model Runner V2 does not yet support {CPU}, {EAGER}; using V1."


def test_zero_forces_v1_silently():
    for cpu, eager in ((False, False), (True, True)):
        choice = _select(False, cpu_sampling=cpu, enforce_eager=eager)
        assert not choice.use_v2 and choice.log_message() is None


def test_one_forces_v2_and_warns_only_about_unsupported_features():
    assert _select(True).log_message() is None
    forced = _select(True, cpu_sampling=True, enforce_eager=True)
    assert forced.use_v2 and forced.forced is True
    assert forced.log_message() == (f"VLLM_USE_V2_MODEL_RUNNER=1 forces Neuron Model Runner V2 with unsupported "
                                    f"features ({CPU}, {EAGER}); execution may fail.")


@pytest.mark.parametrize("model", [dict(moe=True), dict(sliding_window=True), dict(moe=True, sliding_window=True)])
def test_moe_and_sliding_window_models_use_v1_without_a_log_line_unless_forced(model):
    # Seeds: "MoE, sliding-window ... models use MRv1 without a log message"; forced to MRv2 they start
    # without the warning (it names only the configuration's unsupported features).
    for cpu, eager in ((False, False), (True, True)):
        choice = _select(None, cpu_sampling=cpu, enforce_eager=eager, **model)
        assert not choice.use_v2 and choice.log_message() is None
    forced = _select(True, **model)
    assert forced.use_v2 and forced.log_message() is None
    forced_eager = _select(True, enforce_eager=True, **model)
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
    config = resolve(EngineArgs.from_kwargs(max_model_len=256, **kwargs), ModelFacts(2048))
    assert config.use_v2_model_runner is expected
    assert config.runner_choice.forced == (None if raw is None else raw == "1")


@pytest.mark.parametrize("model, kind", [(dict(moe=True), "MoE"), (dict(sliding_window=True), "sliding-window"),
                                         (dict(moe=True, sliding_window=True), "MoE, sliding-window")])
def test_mrv1_model_reason_says_why_but_is_not_the_seeds_line(model, kind):
    choice = _select(None, **model)
    assert choice.model_reason().startswith(f"Model Runner V1: {kind} models use MRv1 by default")
    assert "VLLM_USE_V2_MODEL_RUNNER=1 runs them on MRv2" in choice.model_reason()
    assert "does not yet support" not in choice.model_reason()
    # Forced either way, or a dense model: the choice needs no explanation.
    assert _select(False, **model).model_reason() is None
    assert _select(True, **model).model_reason() is None
    assert _select(None, enforce_eager=True).model_reason() is None


def test_multimodal_models_get_their_own_reason_and_run_on_mrv2_when_forced():
    """A dense Qwen3-VL: MRv1 by default because it is multimodal (the seeds' rule: no seeds' line, our own
    info line naming multimodal, not "MoE"), and VLLM_USE_V2_MODEL_RUNNER=1 runs it on MRv2."""
    choice = _select(None, multimodal=True)
    assert not choice.use_v2 and choice.log_message() is None
    reason = choice.model_reason()
    assert reason.startswith("Model Runner V1: multimodal models use MRv1 by default")
    assert "MoE" not in reason and "VLLM_USE_V2_MODEL_RUNNER=1 runs them on MRv2" in reason
    assert _select(True, multimodal=True).use_v2
    assert not _select(False, multimodal=True).use_v2


@pytest.mark.parametrize("features, use_v2, match", [
    (dict(multimodal=True, speculative="eagle3"), False, "speculative_config='eagle3' .*with a multimodal model.*use "
                                                          "method 'ngram'"),
    (dict(audio=True, tensor_parallel_size=2), False, "tensor_parallel_size=2 .*audio tower is not sharded"),
    (dict(moe=False, expert_parallel=True), False, "enable_expert_parallel=True cannot apply to this model: it has "
                                                   "no experts"),
    (dict(speculative="eagle3"), True, "VLLM_USE_V2_MODEL_RUNNER=1 cannot serve speculative decoding"),
    (dict(speculative="dflash", cpu_sampling=True), False, "speculative decoding requires on-device sampling"),
    (dict(speculative="ngram", async_scheduling=True), False, "async_scheduling=True is not supported with "
                                                               "speculative decoding"),
    (dict(cpu_sampling=True, async_scheduling=True), False, "async_scheduling=True requires on-device sampling"),
    (dict(tensor_parallel_size=2, device="cuda"), False, "tensor_parallel_size=2 .*one GPU per rank"),
    (dict(tensor_parallel_size=2, compile_workers=3), False, "PARALLEL_COMPILE_WORKERS=3 .*tensor_parallel_size=2"),
    (dict(nnodes=2, data_parallel_size=2), False, "nnodes=2 .*data_parallel_size=2"),
    (dict(moe=True, expert_parallel=True, data_parallel_size=2), False, "enable_expert_parallel=True .*"
                                                                         "data_parallel_size=2"),
    (dict(decode_cpp_wrapper=True, eager_backend=True), False, "decode_cpp_wrapper=true needs compiled graphs"),
    (dict(decode_cpp_wrapper=True, device="cuda"), False, "decode_cpp_wrapper=True .*CPU only"),
])
def test_refused_combinations_name_the_reason(features, use_v2, match):
    with pytest.raises(ValueError, match=match):
        check(Features(**features), use_v2=use_v2)
    # Every feature of the row is needed: drop any one and the combination passes.
    for name, value in features.items():
        if name in ("moe",):
            continue
        default = Features.__dataclass_fields__[name].default
        check(Features(**{**features, name: default}), use_v2=False)


def test_allowed_combinations_pass():
    check(Features(moe=True, expert_parallel=True, tensor_parallel_size=2))
    check(Features(**DENSE, speculative="ngram"))
    check(Features(multimodal=True, enforce_eager=True, eager_backend=True))
    check(Features(decode_cpp_wrapper=True))


def test_model_rules_wait_for_the_models_facts():
    # Before the model's config is read (facts None) nothing about the model is refused; once read, it is.
    check(Features(expert_parallel=True))
    check(Features(speculative="eagle3"))
    with pytest.raises(ValueError, match="it has no experts"):
        check(Features(moe=False, expert_parallel=True))
    with pytest.raises(ValueError, match="multimodal"):
        check(Features(multimodal=True, speculative="eagle3"))
    check(Features(multimodal=True, speculative="ngram"))


def test_expert_parallel_on_a_dense_model_is_refused_at_resolution():
    args = EngineArgs.from_kwargs(tensor_parallel_size=2, enable_expert_parallel=True, device="cpu")
    with pytest.raises(ValueError, match="enable_expert_parallel=True cannot apply to this model"):
        resolve(args, ModelFacts(2048))
    assert resolve(args, ModelFacts(2048, moe=True)).neuron_config.ep_degree == 2


def test_rules_are_data_flipping_one_row_lets_the_combination_through(monkeypatch):
    """Letting a combination through is dropping its row: without the multimodal x EAGLE3 row a multimodal model
    may take EAGLE3 (the checks themselves do not change); the other rows still hold."""
    rows = tuple(r for r in C.REFUSED if r.features != {"multimodal", "speculative:eagle3"})
    assert len(rows) == len(C.REFUSED) - 1
    with pytest.raises(ValueError, match="with a multimodal model"):
        _select(None, multimodal=True, speculative="eagle3")
    monkeypatch.setattr(C, "REFUSED", rows)
    assert not _select(None, multimodal=True, speculative="eagle3").use_v2
    with pytest.raises(ValueError, match="with a multimodal model"):
        _select(None, multimodal=True, speculative="dflash")
