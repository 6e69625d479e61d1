"""OpenVINO GenAI as a peer: installed into its own venv under the peers' cache folder, the model exported
there once per weight format with optimum-intel from the same bf16 safetensors the other peers get, and
run offline (OpenVINO GenAI ships no HTTP server; OpenVINO Model Server is a separate C++ product).

The run happens in that venv (`openvino_offline.py`, which imports nothing of ours): the same token ids,
the same output lengths (EOS ignored), greedy, through its ContinuousBatchingPipeline (paged KV, continuous
batching: its serving engine) on the CPU.
"""
from __future__ import annotations

import json
import os
import subprocess

from .install import InstallContext, hf_model_dir, pinned_venv, run_logged

OPENVINO_GENAI_VERSION = "2026.4.1.0"
OPTIMUM_INTEL_VERSION = "2.2.0"
# optimum-cli's --weight-format for each of our precisions: fp16 storage runs in bf16 on a CPU with
# AVX512-BF16 / AMX (OpenVINO's default inference precision there), in fp32 elsewhere, like ours.
WEIGHT_FORMATS = ("fp16", "int8", "int4")
DRIVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openvino_offline.py")


def install_openvino_genai(ctx: InstallContext) -> dict:
    python, pip = pinned_venv(ctx)  # the exporter traces the model with torch: our CPU build, not CUDA's
    venv = os.path.dirname(os.path.dirname(python))
    run_logged(pip + [f"openvino-genai=={OPENVINO_GENAI_VERSION}", f"optimum-intel[openvino]=={OPTIMUM_INTEL_VERSION}"],
               ctx.log_path)
    # torchvision's C ops do not match the pinned torch and break `import transformers`' model classes;
    # text models need none of these.
    run_logged([python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], ctx.log_path)
    run_logged([python, "-c", "import openvino_genai, optimum.intel; print(openvino_genai.__version__)"],
               ctx.log_path)
    return {"python": python, "optimum_cli": os.path.join(venv, "bin", "optimum-cli"),
            "models_dir": os.path.join(ctx.peer_dir, "models"),
            "version": f"openvino-genai {OPENVINO_GENAI_VERSION}"}


def group_size(hidden_size: int) -> int:
    """int4 group size: 128 where it divides the hidden size (optimum's default), else the largest of 64, 32."""
    return next((g for g in (128, 64, 32) if hidden_size % g == 0), 32)


def exported_model(info: dict, model_path: str, weight_format: str, log_path: str) -> str:
    """The OpenVINO IR of `model_path` in `weight_format` (exported once, then reused)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format {weight_format!r}: valid {', '.join(WEIGHT_FORMATS)}")
    hf_dir = hf_model_dir(model_path, info["models_dir"])
    out = os.path.join(info["models_dir"], f"{os.path.basename(hf_dir)}-ov-{weight_format}")
    if os.path.isfile(os.path.join(out, "openvino_model.xml")):
        return out
    cmd = [info["optimum_cli"], "export", "openvino", "--model", hf_dir, "--task", "text-generation-with-past",
           "--weight-format", weight_format]
    if weight_format == "int4":
        with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
            hidden = json.load(f)["hidden_size"]
        cmd += ["--group-size", str(group_size(hidden)), "--ratio", "1.0"]
    run_logged(cmd + [out + ".tmp"], log_path)
    os.replace(out + ".tmp", out)
    return out


def run_offline(info: dict, model_dir: str, requests: list[tuple[list[int], int]], max_num_seqs: int,
                threads: int, props: dict | None = None) -> dict:
    """{"seconds", "output_tokens", ...} of one timed generate over `requests` (after a warm-up); `props`: extra
    OpenVINO CPU properties."""
    job = {"model_dir": model_dir, "requests": requests, "max_num_seqs": max_num_seqs, "threads": threads,
           "props": props or {}}
    proc = subprocess.run([info["python"], DRIVER], input=json.dumps(job), capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"openvino_offline.py exited {proc.returncode}: {proc.stderr[-600:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
