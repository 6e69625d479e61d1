"""Shared pytest setup: CPU only unless GPU tests are asked for, 2 torch threads, tiny local models.

GPUs are hidden (CUDA_VISIBLE_DEVICES="") so that `--device auto` code under test runs on CPU like
on the 2-core dev machines. They stay visible when `VLLM_NEURON_TEST_GPU=1` is set or the run
selects GPU tests (`pytest -m gpu`); tests marked `gpu` are skipped when no CUDA device is visible.
"""

from __future__ import annotations

import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:  # `from tests.model_factory import ...` without pytest's pythonpath
    sys.path.insert(0, _ROOT)


def _gpu_requested(config: pytest.Config) -> bool:
    if os.environ.get("VLLM_NEURON_TEST_GPU") == "1":
        return True
    markexpr = (config.getoption("markexpr", default="") or "").replace(" ", "")
    return "gpu" in markexpr and "notgpu" not in markexpr


def pytest_configure(config: pytest.Config) -> None:
    # Before the first `import torch` of any test module: CUDA reads this when it initializes.
    if not _gpu_requested(config):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Never the user's cache (unset or ~/.cache/vllm_neuron): the tests' own, kept between runs so the
    # custom kernels and the GGUF conversions are built once. A root set elsewhere (a test running pytest
    # in a subprocess with its own temporary root) is kept.
    from tests.model_factory import _cache_root

    users = os.path.expanduser(os.path.join("~", ".cache", "vllm_neuron"))
    if os.path.abspath(os.path.expanduser(os.environ.get("VLLM_CACHE_ROOT") or users)) == os.path.abspath(users):
        os.environ["VLLM_CACHE_ROOT"] = os.path.join(_cache_root(), "vllm_cache_root")
    # Every test compiles into its own temporary compile cache; inductor's kernels and headers are shared by all
    # of them and by the servers and workers they start, so each process's first graph skips inductor's set-up.
    os.environ.setdefault("VLLM_NEURON_INDUCTOR_CACHE_DIR", os.path.join(_cache_root(), "inductor"))
    # Likewise the custom kernels: a test with a cache root of its own (a GGUF conversion cache to itself) does not
    # build them again (30 s on 2 cores); the tests of the build itself unset it.
    os.environ.setdefault("VLLM_NEURON_KERNEL_CACHE_DIR",
                          os.path.join(_cache_root(), "vllm_cache_root", "kernels"))
    import torch

    torch.set_num_threads(2)


# The longest files run first, longest first (seconds per file on a 2-core machine, measured 2026-12-07): `make
# test`'s two workers take whole files in collection order (`--no-loadscope-reorder`; xdist's default order, most
# tests first, left the one-test files of two minutes for the end, run alone while the other worker idled).
_LONGEST_FIRST = ("parity/test_model_parity.py", "integration/test_compile_cache.py", "unit/test_kernels.py",
                  "parity/test_tensor_parallel.py", "integration/test_server_logs.py", "soak/test_soak.py",
                  "integration/test_openai_limits.py", "integration/test_structured_outputs.py",
                  "integration/test_hostile_input.py", "integration/test_setup_install.py",
                  "integration/test_harmony_server.py", "parity/test_spec_decode.py", "parity/test_eagle3.py",
                  "integration/test_server_e2e.py", "parity/test_dflash.py", "parity/test_pipeline_parallel.py",
                  "parity/test_disagg_parity.py", "integration/test_epd_server.py", "integration/test_disagg_server.py",
                  "integration/test_cli.py", "integration/test_reasoning_server.py", "integration/test_web_ui_browser.py",
                  "integration/test_data_parallel.py", "integration/test_disagg_nixl_server.py",
                  "integration/test_tensor_parallel_server.py", "parity/test_weight_quant_parity.py",
                  "parity/test_qwen3_asr_parity.py", "parity/test_lora_parity.py", "parity/test_kv_fp8_parity.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))
    import torch

    if torch.cuda.is_available():
        return
    reason = "needs a CUDA device (none visible; run with -m gpu or VLLM_NEURON_TEST_GPU=1 on a GPU host)"
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _engine_tests_are_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that builds an engine must say so (`pytest.mark.engine`): the fast tier (`make test-fast`) leaves
    those out, so an unmarked one would slow it down unnoticed. Engines built by module- or session-scoped
    fixtures exist before this runs; the files that have such fixtures are marked whole."""
    if request.node.get_closest_marker("engine") is not None:
        return
    from vllm_neuron.engine.core import EngineCore

    def refused(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} builds an engine: mark it with pytest.mark.engine")
    monkeypatch.setattr(EngineCore, "__init__", refused)


@pytest.fixture(scope="module", autouse=True)
def _no_engine_threads_outlive_their_module():
    """An engine a module made must not leave its threads running for the rest of the suite: a leaked KV
    connector kept a NIXL agent polling (a quarter of a core each) and slowed every later test."""
    yield
    import gc
    import threading

    gc.collect()  # an LLM nothing refers to any more shuts its engine down (weakref.finalize)
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith("vllm-neuron-kv"))
    if left:
        pytest.fail(f"threads still running after this module: {left}; shut its engines down "
                    "(LLM.llm_engine.shutdown())", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> str:
    """Directory with the SmolLM2 tokenizer (save_pretrained of the bundled GGUF's tokenizer)."""
    from tests import model_factory

    return model_factory.smollm2_tokenizer_dir()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """HF directory of the default tiny Llama (model_factory.make_tiny_llama defaults, fp32, seed 0).
    Its transformers twin is model_factory.build_tiny_llama()."""
    from tests import model_factory

    return model_factory.make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama")))


@pytest.fixture(scope="session")
def tiny_llama_512_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same tiny Llama with max_position_embeddings 512 (the engine parity tests' model); its
    transformers twin is model_factory.build_tiny_llama(max_position_embeddings=512)."""
    from tests import model_factory

    return model_factory.make_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama_512")), max_position_embeddings=512)


@pytest.fixture(scope="session")
def tiny_llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """F32 GGUF file of the same default tiny Llama (llama.cpp layout, SmolLM2 tokenizer metadata)."""
    from tests import model_factory

    return model_factory.make_tiny_gguf(str(tmp_path_factory.mktemp("tiny_gguf")))
