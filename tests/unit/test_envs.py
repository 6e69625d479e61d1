"""Environment variables (lazy parsing, defaults, errors) and the logger."""

import logging
import os
import re

import pytest

from vllm_neuron import envs, logger as vlog

ALL = envs.ALL_VARIABLES


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ALL:
        monkeypatch.delenv(name, raising=False)


def test_every_seed_variable_is_known_and_documented():
    seeds = [
        "VLLM_NEURON_BACKEND", "NEURON_COMPILED_ARTIFACTS", "VLLM_NEURON_CPU_COMPILE",
        "NEURON_PLATFORM_TARGET_OVERRIDE", "NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS",
        "NEURON_LIBTORCH_REMOTE_CACHE", "NEURON_LIBTORCH_DISABLE_COMPILE_CACHE",
        "NEURON_LIBTORCH_COMPILATION_TIMEOUT", "VLLM_NEURON_DISABLE_WARMUP_COMPILE", "VLLM_CACHE_ROOT",
        "VLLM_NEURON_CPU_MODE", "VLLM_NEURON_LOG_LEVEL", "VLLM_NEURON_DISABLE_NKI_KERNELS",
        "VLLM_NEURON_ATTN_MASK_TORCH", "VLLM_USE_V2_MODEL_RUNNER",
        "VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION", "VLLM_NEURON_RESERVED_HEADROOM_GIB",
        "VLLM_NEURON_MIN_KV_BUDGET_GIB", "PROMETHEUS_MULTIPROC_DIR",
    ]
    ours = ["VLLM_NEURON_AOT_COMPILE", "VLLM_NEURON_GGUF_CACHE_MAX_GIB", "VLLM_NEURON_CUDA_GRAPHS",
            "VLLM_LOG_STATS_INTERVAL", "VLLM_NEURON_CPU_ISA", "VLLM_IMAGE_FETCH_TIMEOUT",
            "VLLM_MEDIA_MAX_BYTES", "VLLM_ENGINE_ITERATION_TIMEOUT_S", "VLLM_NEURON_DIST_TIMEOUT_S",
            "VLLM_NEURON_INDUCTOR_CACHE_DIR", "VLLM_NEURON_KV_PREFAULT_MB", "VLLM_NEURON_HUGE_PAGES", "VLLM_NEURON_KV_HUGE_PAGES",
            "VLLM_NEURON_PP_MICRO_BATCHES",
            "VLLM_NEURON_KV_OFFLOAD_DIR", "VLLM_NEURON_KERNEL_CACHE_DIR", "VLLM_MAX_AUDIO_CLIP_FILESIZE_MB", "VLLM_NEURON_MAX_AUDIO_SECONDS",
            "VLLM_LOGGING_STREAM", "VLLM_MEDIA_URL_ALLOW_REDIRECTS",
            "VLLM_ENABLE_RESPONSES_API_STORE", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "HF_ENDPOINT", "HF_HUB_OFFLINE",
            "VLLM_NEURON_STEP_TIMING", "VLLM_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_RECORD_SHAPES",
            "VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY", "VLLM_TORCH_PROFILER_WITH_STACK",
            "VLLM_TORCH_PROFILER_WITH_FLOPS"]  # beyond the seeds
    assert sorted(seeds + ours) == sorted(ALL)
    for name in seeds + ours:
        assert len(envs.doc(name)) > 20, name
    with pytest.raises(AttributeError):
        envs.NOT_A_VARIABLE


def test_defaults():
    assert envs.VLLM_NEURON_BACKEND == "native"
    assert envs.NEURON_COMPILED_ARTIFACTS is None
    assert envs.VLLM_NEURON_CPU_COMPILE is False
    assert envs.VLLM_NEURON_DISABLE_WARMUP_COMPILE is False
    assert envs.VLLM_NEURON_AOT_COMPILE is True
    assert envs.VLLM_USE_V2_MODEL_RUNNER is None
    assert envs.VLLM_NEURON_CUDA_GRAPHS == "decode"
    assert envs.VLLM_NEURON_HUGE_PAGES is True
    assert envs.VLLM_NEURON_KV_HUGE_PAGES is False
    assert envs.VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION == 0.30
    assert envs.VLLM_NEURON_RESERVED_HEADROOM_GIB is None
    assert envs.VLLM_NEURON_MIN_KV_BUDGET_GIB == 1.0
    assert envs.VLLM_NEURON_LOG_LEVEL == "INFO"
    assert envs.VLLM_CACHE_ROOT == os.path.expanduser("~/.cache/vllm_neuron")
    assert envs.describe() == {}


def test_values_are_read_lazily(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_MIN_KV_BUDGET_GIB", "2.5")
    assert envs.VLLM_NEURON_MIN_KV_BUDGET_GIB == 2.5
    monkeypatch.setenv("VLLM_NEURON_MIN_KV_BUDGET_GIB", "0.5")
    assert envs.VLLM_NEURON_MIN_KV_BUDGET_GIB == 0.5


@pytest.mark.parametrize("raw, expected", [("neuron_native", "native"), ("neuron", "native"), ("eager", "eager"), ("", "native")])
def test_backend_values(monkeypatch, raw, expected):
    monkeypatch.setenv("VLLM_NEURON_BACKEND", raw)
    assert envs.VLLM_NEURON_BACKEND == expected


def test_backend_xla_route_is_an_error(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_BACKEND", "vllm_neuron")
    with pytest.raises(ValueError, match="XLA route.*not available"):
        envs.VLLM_NEURON_BACKEND


def test_backend_invalid_value_warns_and_selects_native(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_NEURON_BACKEND", "tpu-please")
    with caplog.at_level(logging.WARNING, logger="vllm_neuron"):
        assert envs.VLLM_NEURON_BACKEND == "native"
    assert any("tpu-please" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


@pytest.mark.parametrize("raw, expected", [("0", False), ("1", True), ("true", True), ("FALSE", False), ("True", True)])
def test_booleans(monkeypatch, raw, expected):
    monkeypatch.setenv("VLLM_NEURON_DISABLE_WARMUP_COMPILE", raw)
    assert envs.VLLM_NEURON_DISABLE_WARMUP_COMPILE is expected


def test_bad_boolean_names_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_CPU_MODE", "yes")
    with pytest.raises(ValueError, match="VLLM_NEURON_CPU_MODE='yes'.*0, 1, true, false"):
        envs.VLLM_NEURON_CPU_MODE


@pytest.mark.parametrize(
    "name, raw, pattern",
    [
        ("NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS", "four", "not an integer"),
        ("NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS", "0", "must be >= 1"),
        ("NEURON_LIBTORCH_COMPILATION_TIMEOUT", "1.5", "not an integer"),
        ("VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION", "lots", "not a number"),
        ("VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION", "1.5", "must be <= 1"),
        ("VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION", "0", "must be > 0"),
        ("VLLM_NEURON_RESERVED_HEADROOM_GIB", "-1", "must be >= 0"),
        ("VLLM_NEURON_MIN_KV_BUDGET_GIB", "nan", "finite"),
    ],
)
def test_bad_numbers_name_the_variable(monkeypatch, name, raw, pattern):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=f"^{name}.*{pattern}"):
        getattr(envs, name)


def test_numbers(monkeypatch):
    monkeypatch.setenv("NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS", "4")
    monkeypatch.setenv("VLLM_NEURON_RESERVED_HEADROOM_GIB", "0")
    monkeypatch.setenv("VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION", "0.5")
    assert envs.NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS == 4
    assert envs.VLLM_NEURON_RESERVED_HEADROOM_GIB == 0.0  # zero is a value, not "unset"
    assert envs.VLLM_NEURON_KV_GMU_BUDGET_CAP_FRACTION == 0.5


@pytest.mark.parametrize("raw, expected", [("0", False), ("1", True)])
def test_v2_model_runner(monkeypatch, raw, expected):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", raw)
    assert envs.VLLM_USE_V2_MODEL_RUNNER is expected


def test_v2_model_runner_invalid(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "true")
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER='true'.*unset.*0.*1"):
        envs.VLLM_USE_V2_MODEL_RUNNER


def test_log_level_variable(monkeypatch):
    monkeypatch.setenv("VLLM_NEURON_LOG_LEVEL", "debug")
    assert envs.VLLM_NEURON_LOG_LEVEL == "DEBUG"
    monkeypatch.setenv("VLLM_NEURON_LOG_LEVEL", "chatty")
    with pytest.raises(ValueError, match="VLLM_NEURON_LOG_LEVEL"):
        envs.VLLM_NEURON_LOG_LEVEL


def test_compile_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))
    assert envs.compile_cache_dir() == str(tmp_path / "root" / "compiled_artifacts")
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", str(tmp_path / "arts"))
    assert envs.compile_cache_dir() == str(tmp_path / "arts")


@pytest.mark.parametrize("name, value", [
    ("VLLM_NEURON_CPU_COMPILE", "1"), ("NEURON_PLATFORM_TARGET_OVERRIDE", "cuda"),
    ("VLLM_NEURON_ATTN_MASK_TORCH", "true"),
])
def test_variables_without_a_feature_here_are_refused_at_startup(monkeypatch, name, value):
    from vllm_neuron.config.engine_args import EngineArgs

    EngineArgs.from_kwargs()
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"not supported yet.*{name}"):
        EngineArgs.from_kwargs()


def test_unset_or_default_values_are_accepted(monkeypatch):
    from vllm_neuron.config.engine_args import EngineArgs

    for name, value in [("VLLM_NEURON_CPU_COMPILE", "0"), ("VLLM_NEURON_ATTN_MASK_TORCH", "0"),
                        ("NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS", "4")]:
        monkeypatch.setenv(name, value)
    EngineArgs.from_kwargs()


def test_cpu_mode_forces_the_cpu(monkeypatch):
    import torch

    from vllm_neuron.config.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto").type == "cuda"
    monkeypatch.setenv("VLLM_NEURON_CPU_MODE", "1")
    assert resolve_device("auto").type == "cpu" and resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="VLLM_NEURON_CPU_MODE=1"):
        resolve_device("cuda")


def test_describe_lists_set_values(monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setenv("NEURON_COMPILED_ARTIFACTS", "/tmp/x")
    assert envs.describe() == {"NEURON_COMPILED_ARTIFACTS": "/tmp/x", "VLLM_USE_V2_MODEL_RUNNER": False}
    monkeypatch.setenv("VLLM_NEURON_CPU_MODE", "maybe")
    with pytest.raises(ValueError, match="VLLM_NEURON_CPU_MODE"):
        envs.describe()


# --- logger ---

def test_logger_names_and_format():
    log = vlog.init_logger("vllm_neuron.worker.memory")
    assert log.name == "vllm_neuron.worker.memory"
    assert vlog.init_logger("thirdparty").name == "vllm_neuron.thirdparty"
    handler = vlog._handler
    assert handler is not None and handler in logging.getLogger("vllm_neuron").handlers
    record = log.makeRecord(log.name, logging.INFO, "/x/model_runner.py", 123, "hello %s", ("world",), None)
    line = handler.format(record)
    assert re.fullmatch(r"INFO \d\d-\d\d \d\d:\d\d:\d\d \[model_runner\.py:123\] hello world", line), line


def test_log_level_from_env(monkeypatch):
    root = logging.getLogger("vllm_neuron")
    try:
        monkeypatch.setenv("VLLM_NEURON_LOG_LEVEL", "DEBUG")
        vlog.configure_root_logger()
        assert root.level == logging.DEBUG
        monkeypatch.setenv("VLLM_NEURON_LOG_LEVEL", "nonsense")
        vlog.configure_root_logger()  # invalid level: warning, INFO, no crash
        assert root.level == logging.INFO
        with pytest.raises(ValueError, match="DEBUG, INFO"):
            vlog.configure_root_logger("LOUD")
    finally:
        monkeypatch.delenv("VLLM_NEURON_LOG_LEVEL")
        vlog.configure_root_logger()
    assert len([h for h in root.handlers if h is vlog._handler]) == 1  # no duplicate handlers


def test_logging_stream_from_env(monkeypatch, capsys):
    log = vlog.init_logger("vllm_neuron.test_stream")
    before = vlog._handler.stream  # the session's stdout: capsys' streams close after this test
    try:
        monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        vlog.configure_root_logger()
        log.info("to stderr")
        monkeypatch.setenv("VLLM_LOGGING_STREAM", "ext://sys.stdout")
        vlog.configure_root_logger()
        log.info("to stdout")
        out, err = capsys.readouterr()
        assert "to stderr" in err and "to stderr" not in out
        assert "to stdout" in out and "to stdout" not in err
        assert envs.VLLM_LOGGING_STREAM == "ext://sys.stdout"
        monkeypatch.setenv("VLLM_LOGGING_STREAM", "sys.stderr")
        with pytest.raises(ValueError, match="ext://sys.stderr"):
            envs.VLLM_LOGGING_STREAM
    finally:
        monkeypatch.delenv("VLLM_LOGGING_STREAM")
        vlog.configure_root_logger()
        vlog._handler.setStream(before)


def test_warning_once(caplog):
    log = vlog.init_logger("vllm_neuron.test_once")
    with caplog.at_level(logging.WARNING, logger="vllm_neuron"):
        assert vlog.warning_once(log, "batch %s changed", "composition")
        assert not vlog.warning_once(log, "batch %s changed", "composition")
        assert vlog.warning_once(log, "batch %s changed", "size")
    msgs = [r.getMessage() for r in caplog.records if r.name == "vllm_neuron.test_once"]
    assert msgs == ["batch composition changed", "batch size changed"]
    assert all(r.filename == "test_envs.py" for r in caplog.records if r.name == "vllm_neuron.test_once")


def test_warning_once_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(vlog, "_once_keys", {})
    log = vlog.init_logger("vllm_neuron.test_once_bound")
    for i in range(vlog.ONCE_CAPACITY + 10):
        assert vlog.warning_once(log, "request %d is odd", i)
    assert len(vlog._once_keys) == vlog.ONCE_CAPACITY
    assert vlog.warning_once(log, "request %d is odd", 0)  # the oldest was forgotten
    assert not vlog.warning_once(log, "request %d is odd", vlog.ONCE_CAPACITY + 9)  # recent ones are kept



def test_parallel_compile_workers_refused_with_tensor_parallelism(monkeypatch):
    from vllm_neuron.config.engine_args import EngineArgs

    EngineArgs.from_kwargs(tensor_parallel_size=2)
    monkeypatch.setenv("NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS", "2")
    with pytest.raises(ValueError, match="NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS=2 is not supported yet.*"
                                         "tensor_parallel_size=2"):
        EngineArgs.from_kwargs(tensor_parallel_size=2)
