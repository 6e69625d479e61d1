"""Processes (here: threads, each with its own lock file handle) that find the custom kernels unbuilt at the
same time build them once: the others wait for the first one's library."""
from __future__ import annotations

import threading
import time

from vllm_neuron.model.layers.kernels import build


def test_concurrent_loads_build_once(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.delenv("VLLM_NEURON_KERNEL_CACHE_DIR", raising=False)
    builds = []

    def fake_compile(out, variant):
        builds.append(variant)
        time.sleep(0.3)
        out.write_bytes(b"not a library")

    monkeypatch.setattr(build, "_compile", fake_compile)
    results = []
    threads = [threading.Thread(target=lambda: results.append(build.load.__wrapped__("generic"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert builds == ["generic"]
    assert results == [False, False, False]  # the fake library does not load: the torch paths take over
    assert (tmp_path / "kernels").is_dir()
