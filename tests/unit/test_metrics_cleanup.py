"""The metrics module's temporary folder goes with the process that made it: at exit and on SIGTERM / SIGHUP,
whose default action skips atexit (a test run or a loading server killed by them left it in the temp dir)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(tmp_path, before_import: str = "") -> tuple[subprocess.Popen, str]:
    """A process importing vllm_neuron.metrics with no PROMETHEUS_MULTIPROC_DIR, after running `before_import`;
    returns it and the folder the module made."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=_REPO + os.pathsep + env.get("PYTHONPATH", ""))
    code = (f"import signal, sys, time\n{before_import}\nimport vllm_neuron.metrics as m\n"
            "print(m.MULTIPROC_DIR, flush=True)\ntime.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    folder = proc.stdout.readline().strip()
    assert os.path.isdir(folder) and os.path.dirname(folder) == str(tmp_path), folder
    assert os.path.basename(folder).startswith("vllm_neuron_prometheus_")
    return proc, folder


# The signals' default actions in the child whatever this process inherited (under nohup SIGHUP arrives ignored,
# and an ignored signal is a disposition the module leaves alone: see the last test).
_DEFAULTS = "signal.signal(signal.SIGTERM, signal.SIG_DFL); signal.signal(signal.SIGHUP, signal.SIG_DFL)"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_folder_removed_when_killed_by_signal(tmp_path, sig):
    proc, folder = _start(tmp_path, _DEFAULTS)
    proc.send_signal(sig)
    assert proc.wait(30) == -sig  # still dies of the signal, as its default action does
    assert not os.path.exists(folder)


def test_a_handler_installed_before_is_left_alone(tmp_path):
    # The application's own SIGTERM handler (set before the import) keeps the signal; its exit runs atexit.
    proc, folder = _start(tmp_path, "signal.signal(signal.SIGTERM, lambda *a: sys.exit(3))")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 3
    assert not os.path.exists(folder)


def test_an_ignored_sighup_stays_ignored(tmp_path):
    # A process started under nohup keeps running through SIGHUP; SIGTERM still removes the folder.
    proc, folder = _start(tmp_path, _DEFAULTS + "; signal.signal(signal.SIGHUP, signal.SIG_IGN)")
    proc.send_signal(signal.SIGHUP)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    assert not os.path.exists(folder)
