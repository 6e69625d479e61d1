"""`make setup` on a machine without an NVIDIA GPU resolves a CPU-only torch and no `nvidia-*` package.

The setup script resolves the whole install (pip --dry-run --report) in a fresh virtual environment under a
temporary folder, with the index logic `make setup` uses (scripts/setup_venv.py). Where the machine has an
NVIDIA GPU, the CPU path is asked for explicitly (TORCH_BUILD=cpu): what a CPU-only machine would get.
Skipped, with pip's own words, only where no package index can be reached.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

pytestmark = pytest.mark.network

_ROOT = Path(__file__).resolve().parent.parent.parent
_SCRIPT = _ROOT / "scripts" / "setup_venv.py"
_UNREACHABLE = re.compile(r"NewConnectionError|Name or service not known|Temporary failure in name resolution|"
                          r"Network is unreachable|Connection refused|ConnectTimeout|Max retries exceeded")


def _torch_pin() -> str:
    m = re.search(r"^torch==(\S+)", (_ROOT / "constraints.txt").read_text(), re.MULTILINE)
    assert m, "constraints.txt pins torch"
    return m.group(1)


def _resolve(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, dict]:
    """Runs the setup script's --resolve-only; returns {lower-case name: its entry of pip's report}."""
    build = "cpu" if shutil.which("nvidia-smi") else "auto"
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(_SCRIPT), "--venv", str(tmp_path / "venv"), "--torch-build", build,
                           "--resolve-only", str(report), *args], capture_output=True, text=True, timeout=900,
                          env=env)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        if _UNREACHABLE.search(out):
            reason = next(ln for ln in out.splitlines() if _UNREACHABLE.search(ln)).strip()
            print(f"no package index reachable: {reason}")
            pytest.skip(f"no package index reachable: {reason[:300]}")
        pytest.fail(f"the setup script's resolution failed:\n{out[-4000:]}")
    print(out[-2000:])
    return {i["metadata"]["name"].lower(): i for i in json.loads(report.read_text())["install"]}


def _assert_cpu_only(resolved: dict[str, dict]) -> dict:
    cuda = sorted(n for n in resolved if n.startswith("nvidia-"))
    assert not cuda, f"a CUDA install: {cuda}"
    torch = resolved["torch"]["metadata"]
    needs = [r for r in torch.get("requires_dist", []) if r.startswith("nvidia-")]
    assert torch["version"].endswith("+cpu") or not needs, f"torch {torch['version']} requires {needs}"
    assert torch["version"].split("+")[0] == _torch_pin()
    return resolved["torch"]


def test_setup_resolves_a_cpu_only_torch(tmp_path):
    """With this machine's indexes: PyTorch's CPU index, else the default one (here pip's configuration
    supplies the CPU wheel; resolved against PyPI alone, torch==2.13.0 is the CUDA build with ~16 nvidia-*
    packages, and this test fails)."""
    torch = _assert_cpu_only(_resolve(tmp_path))
    print(f"torch {torch['metadata']['version']} from {torch['download_info']['url']}")


def _local_cpu_wheel() -> str | None:
    """A CPU torch wheel of the pinned version for this Python among pip's find-links folders, if any."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in filter(None, os.environ.get("PIP_FIND_LINKS", "").split()):
        found = glob.glob(os.path.join(folder, f"torch-{_torch_pin()}+cpu-{tag}-*.whl"))
        if found:
            return found[0]
    return None


def test_a_reachable_cpu_index_wins_over_the_default_index(tmp_path):
    """The "CPU index first" half: a local stand-in for PyTorch's CPU index (a file:// simple index serving
    the CPU wheel), pip's configuration left out so the CPU wheel has no other source: the install takes
    torch from that index, although the default index offers the same version as the CUDA build."""
    wheel = _local_cpu_wheel()
    if wheel is None:
        pytest.skip("no local CPU torch wheel (PIP_FIND_LINKS) to stand in for PyTorch's CPU index")
    page = tmp_path / "cpu_index" / "torch"
    page.mkdir(parents=True)
    href = Path(wheel).as_uri()
    page.joinpath("index.html").write_text(f'<a href="{href}">{os.path.basename(wheel)}</a>\n')
    env = {k: v for k, v in os.environ.items() if k != "PIP_FIND_LINKS"}
    env["PIP_CONFIG_FILE"] = os.devnull  # no configured find-links or extra indexes: PyPI and the stand-in only
    resolved = _resolve(tmp_path, "--cpu-index", (tmp_path / "cpu_index").as_uri(), env=env)
    torch = _assert_cpu_only(resolved)
    assert unquote(torch["download_info"]["url"]) == unquote(href), torch["download_info"]["url"]
