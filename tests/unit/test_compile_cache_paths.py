"""The compile cache's keys, files and paths, on a one-layer function (no model, no engine): host
identity in the keys, atomic writes, the no-aot_compile fallback, the compile timeout and the remote
folder."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import torch

from vllm_neuron.worker import compilation as C


class _Graphs:
    """Stands in for StepGraphs: a bound method of an object holding `.model`."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(8, 8)

    def step(self, x):
        return torch.relu(self.model(x)) * 2


def _key(**over) -> dict:
    return C.cache_key_parts({"hidden_size": 8, **over}, torch.float32, torch.device("cpu"), 1, {})


@pytest.fixture
def caching(monkeypatch):
    for var in ("NEURON_LIBTORCH_DISABLE_COMPILE_CACHE", "NEURON_LIBTORCH_REMOTE_CACHE",
                "NEURON_LIBTORCH_COMPILATION_TIMEOUT", "VLLM_NEURON_AOT_COMPILE"):
        monkeypatch.delenv(var, raising=False)
    # An earlier test with the cache disabled turns inductor's caches off for the whole process.
    import torch._inductor.config

    with torch._inductor.config.patch(force_disable_caches=False):
        yield


def _warm(compiler: C.GraphCompiler, graphs: _Graphs, name: str = "decode_b1") -> torch.Tensor:
    x = torch.ones(2, 8)
    bucket = compiler.bucket(name, graphs.step)
    compiler.warm(name, lambda: bucket(x))
    return bucket(x)


def test_keys_cover_the_cpu_instruction_set_and_the_compiler(monkeypatch):
    from vllm_neuron.model.layers.kernels import build

    key = _key()
    assert key["host"]["cpu_isa"] and key["host"]["cxx"]
    kernel_digest = build.digest("avx2")
    monkeypatch.setattr(C, "cpu_isa", lambda: "x86_64:avx,avx2")
    assert C.GraphCompiler(_key(), backend="eager").key != C.GraphCompiler(key, backend="eager").key
    monkeypatch.setattr(build, "cpu_isa", lambda: "x86_64:avx,avx2")
    assert build.digest("avx2") != kernel_digest
    monkeypatch.undo()
    monkeypatch.setattr(build, "compiler_id", lambda cxx: "/usr/bin/g++: g++ (GCC) 99.1")
    assert build.digest("avx2") != kernel_digest
    monkeypatch.undo()
    assert build.digest("generic") != kernel_digest  # the variant's own flags
    monkeypatch.setattr(C, "compiler_id", lambda cxx: "/usr/bin/g++: g++ (GCC) 99.1")
    assert _key()["host"] != key["host"]


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "g.bin"
    target.write_bytes(b"old graph")

    def crash(tmp: str) -> None:
        Path(tmp).write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        C._write_atomic(target, crash)
    assert target.read_bytes() == b"old graph" and os.listdir(tmp_path) == ["g.bin"]


def test_saved_graph_is_written_atomically_and_loads(tmp_path, monkeypatch, caching):
    written = []
    real = C._write_atomic
    monkeypatch.setattr(C, "_write_atomic", lambda path, write: (written.append(path), real(path, write)))
    graphs = _Graphs()
    out = _warm(C.GraphCompiler({"t": "atomic"}, root=str(tmp_path)), graphs)
    key_dir = next(p for p in tmp_path.iterdir() if p.name != "inductor")
    assert key_dir / "aot" / "decode_b1.bin" in written
    assert not list(key_dir.rglob("*.tmp"))
    again = C.GraphCompiler({"t": "atomic"}, root=str(tmp_path))
    assert torch.equal(_warm(again, graphs), out) and again._source == "loaded"


def test_torch_without_aot_compile_saves_and_loads_cache_artifacts(tmp_path, monkeypatch, caplog, caching):
    real_compile = torch.compile

    def compile_without_aot(fn, **kw):
        compiled = real_compile(fn, **kw)
        return lambda *a, **k: compiled(*a, **k)  # what torch 2.11 on CUDA offers: no .aot_compile

    monkeypatch.setattr(torch, "compile", compile_without_aot)
    assert not C.aot_compile_available()
    graphs = _Graphs()
    with caplog.at_level(logging.INFO, logger="vllm_neuron"):
        cold = C.GraphCompiler({"t": "no-aot"}, root=str(tmp_path))
        out = _warm(cold, graphs)
        cold.finish()
    assert "torch.compiler cache artifacts (this torch has no aot_compile" in caplog.text
    assert "ahead-of-time compilation failed" not in caplog.text
    assert cold._artifacts_path.stat().st_size > 0 and not (cold.dir / "aot").exists()
    loaded = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", lambda data: loaded.append(data))
    warm = C.GraphCompiler({"t": "no-aot"}, root=str(tmp_path))
    assert loaded == [cold._artifacts_path.read_bytes()]
    assert torch.equal(_warm(warm, graphs), out) and torch.equal(out, graphs.step(torch.ones(2, 8)))


def test_compile_timeout_names_the_bucket(tmp_path, monkeypatch, caching):
    monkeypatch.setenv("NEURON_LIBTORCH_COMPILATION_TIMEOUT", "1")
    compiler = C.GraphCompiler({"t": "timeout"}, root=str(tmp_path))
    t0 = time.perf_counter()
    with pytest.raises(C.CompileTimeout, match="Bucket prefill_s32: .*NEURON_LIBTORCH_COMPILATION_TIMEOUT=1"):
        compiler.warm("prefill_s32", lambda: time.sleep(5))
    assert time.perf_counter() - t0 < 3
    compiler.warm("decode_b1", lambda: None)  # the timer is gone after a bucket that finished in time
    time.sleep(1.2)


def test_compile_timeout_survives_code_that_swallows_exceptions(tmp_path, monkeypatch, caching):
    """Inductor catches every exception in places: the first signal landing there is lost, the next one still
    stops the compile; and a compile that swallowed them all fails once it returns past its limit."""
    monkeypatch.setenv("NEURON_LIBTORCH_COMPILATION_TIMEOUT", "1")
    compiler = C.GraphCompiler({"t": "timeout"}, root=str(tmp_path))
    caught = []

    def swallows_once():
        try:
            time.sleep(5)
        except Exception as e:  # noqa: BLE001 - as inductor's ISA probe does
            caught.append(e)
        time.sleep(5)

    t0 = time.perf_counter()
    with pytest.raises(C.CompileTimeout, match="Bucket prefill_s32: "):
        compiler.warm("prefill_s32", swallows_once)
    assert time.perf_counter() - t0 < 3 and len(caught) == 1

    def swallows_all():
        end = time.perf_counter() + 1.5
        while time.perf_counter() < end:
            try:
                time.sleep(0.05)
            except C.CompileTimeout:
                pass

    with pytest.raises(C.CompileTimeout, match="Bucket decode_b1: "):
        compiler.warm("decode_b1", swallows_all)
    compiler.warm("decode_b2", lambda: None)  # in time: no error, and no timer left behind
    time.sleep(1.2)


def test_remote_folder_serves_graphs_compiled_on_another_machine(tmp_path, monkeypatch, caplog, caching):
    remote = tmp_path / "shared"
    monkeypatch.setenv("NEURON_LIBTORCH_REMOTE_CACHE", str(remote))
    graphs = _Graphs()
    builder = C.GraphCompiler({"t": "remote"}, root=str(tmp_path / "machine_a"))
    builder.set_num_blocks(8)
    out = _warm(builder, graphs)
    builder.finish()
    assert (remote / builder.key / "aot" / "decode_b1.bin").exists()
    with caplog.at_level(logging.INFO, logger="vllm_neuron"):
        server = C.GraphCompiler({"t": "remote"}, root=str(tmp_path / "machine_b"))
        assert server.manifest_num_blocks == 8
        server.set_num_blocks(8)
        assert torch.equal(_warm(server, graphs), out)
    assert server._source == "loaded" and "took 1 saved graphs (decode_b1)" in caplog.text
    assert (tmp_path / "machine_b" / server.key / "aot" / "decode_b1.bin").exists()


def test_the_test_suite_never_uses_the_users_cache():
    users = Path(os.path.expanduser("~/.cache/vllm_neuron"))
    root = Path(os.environ["VLLM_CACHE_ROOT"])  # set by tests/conftest.py before any test runs
    assert root != users and users not in root.parents


def test_inductor_cache_folder_follows_the_variable(tmp_path, monkeypatch, caching):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unchanged")
    monkeypatch.delenv("VLLM_NEURON_INDUCTOR_CACHE_DIR", raising=False)
    C.GraphCompiler({"t": "inductor dir"}, root=str(tmp_path / "a"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "a" / "inductor")
    monkeypatch.setenv("VLLM_NEURON_INDUCTOR_CACHE_DIR", str(tmp_path / "shared"))
    shared = C.GraphCompiler({"t": "inductor dir"}, root=str(tmp_path / "b"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "shared")
    assert [p.name for p in (tmp_path / "b").iterdir()] == [shared.key]  # no inductor folder of its own
