"""The engines' IPC socket folder: a socket path holds at most 107 bytes, so a long TMPDIR (pytest-xdist's,
a container's) must not make the server fail at start."""
from __future__ import annotations

import os
import tempfile

from vllm_neuron.engine.core_client import _ipc_dir


def test_a_long_tmpdir_falls_back_to_tmp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    folder = _ipc_dir()
    try:
        assert folder.startswith("/tmp/vllm_neuron_ipc_") and len(os.path.join(folder, "engines")) <= 100
    finally:
        os.rmdir(folder)
    short_tmp = tempfile.mkdtemp(prefix="t", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", short_tmp)
    short = _ipc_dir()  # a short TMPDIR is used as it is
    assert os.path.dirname(short) == short_tmp
    os.rmdir(short)
    os.rmdir(short_tmp)
