"""benchmarks/compare_peers.py: end to end against our own server on a tiny model, and the peer
install / start failure paths with fake peers (no network: nothing here installs a real peer)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from tests.integration.bench_scripts import REPO, load_script, script_path

_SCRIPT = script_path("compare_peers")


@pytest.fixture(scope="module")
def cp():
    return load_script("compare_peers")


def _table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ")]


@pytest.mark.engine
def test_ours_p2_end_to_end(tiny_llama_dir, tmp_path):
    from tests.model_factory import build_tiny_llama

    results = tmp_path / "results"
    # The tests' cache root (conftest): the kernels are built once per session, not again here; eager
    # serving of an HF folder writes nothing else there.
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path / "prom"))
    os.makedirs(env["PROMETHEUS_MULTIPROC_DIR"])
    proc = subprocess.run(
        [sys.executable, _SCRIPT, "--peers", "ours", "--workloads", "P2", "--num-prompts-scale", "0.125",
         "--model", tiny_llama_dir, "--cache-dir", str(tmp_path / "cache"), "--result-dir", str(results),
         "--ready-timeout", "300",
         "--ours-args", "--enforce-eager --max-model-len 512 --num-gpu-blocks-override 128"],
        capture_output=True, text=True, timeout=420, env=env, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _table_rows(proc.stdout)
    assert rows[0][:2] == ["engine", "P1 output tok/s"]
    ours = next(r for r in rows if r[0] == "vllm-neuron (ours)")
    assert ours[-1] == "ok", proc.stdout
    assert ours[1] == "-"  # P1 was not run
    # The table rounds to 0.1 ms: the tiny model's TPOT can show 0.0 there when a loaded machine delays the stream
    # (the figures' own check is below, on the saved result).
    p2_ttft, p2_tpot = (float(x) for x in ours[3].split(" / "))
    assert p2_ttft > 0 and p2_tpot >= 0
    assert not any(r[0] == "ours / best peer" for r in rows)  # no peer ran: nothing to compare to

    saved = sorted(p for p in os.listdir(results) if p.startswith("compare_peers-"))
    assert len(saved) == 1
    report = json.loads((results / saved[0]).read_text())
    assert report["table"] in proc.stdout
    (engine,) = report["engines"]
    runs = [r for r in engine["runs"] if r["workload"] == "P2"]
    assert len(runs) == 1
    with open(runs[0]["result_path"]) as f:
        bench = json.load(f)
    # 8 requests scaled by 1/8, with its full output (ignore_eos).
    assert bench["completed"] == 1 and bench["max_concurrency"] == 1
    assert bench["output_lens"] == [128]
    assert engine["figures"]["p2_median_tpot_ms"] == pytest.approx(bench["median_tpot_ms"])
    assert bench["median_tpot_ms"] > 0
    assert engine["figures"]["p2_mean_ttft_ms"] == pytest.approx(bench["mean_ttft_ms"])

    roof = report["roofline"]
    n_params = sum(p.numel() for p in build_tiny_llama().parameters())
    assert roof["weight_bytes_bf16"] == 2 * n_params
    assert roof["ours_step_ms"] == pytest.approx(engine["figures"]["p2_median_tpot_ms"])
    assert roof["read_bandwidth_gb_s"] > 0.5
    assert "% of the roofline" in proc.stdout


def test_failing_peers_are_reported_and_the_run_goes_on(cp, smollm2_tokenizer_dir, tmp_path):
    calls = {"broken": 0, "dead": 0}

    def broken_install(ctx):
        calls["broken"] += 1
        raise RuntimeError("pip: network unreachable")

    def dead_install(ctx):
        calls["dead"] += 1
        return {"exit_code": 3}

    def dead_spec(info, opts):
        return cp.ServerSpec([sys.executable, "-c", f"import sys; sys.exit({info['exit_code']})"])

    peers = {"broken": cp.Peer("Broken peer", broken_install, dead_spec),
             "dead": cp.Peer("Dead peer", dead_install, dead_spec)}
    argv = ["--peers", "broken,dead", "--model", smollm2_tokenizer_dir, "--cache-dir", str(tmp_path),
            "--no-roofline", "--ready-timeout", "30"]
    opts = cp.parse_options(argv, peers)
    report = cp.run_comparison(opts, peers)
    rows = {r[0]: r for r in _table_rows(report["table"])}
    assert rows["Broken peer"][-1] == "install failed: pip: network unreachable"
    assert rows["Dead peer"][-1].startswith("start failed: exited 3")
    assert rows["Dead peer"][1:5] == ["-", "- / -", "- / -", "- / -"]
    assert os.path.isfile(report["json_path"])
    with open(report["json_path"]) as f:
        engines = {e["name"]: e for e in json.load(f)["engines"]}
    assert engines["dead"]["install_fresh"] is True and engines["dead"]["install_seconds"] >= 0

    # A finished install is cached; a failed one is retried on the next run.
    report = cp.run_comparison(opts, peers)
    assert calls == {"broken": 2, "dead": 1}
    engines = {e["name"]: e for e in report["engines"]}
    assert engines["dead"]["install_fresh"] is False


def test_ratio_row_compares_ours_with_the_best_peer(cp):
    from peers.report import EngineResult, format_table

    results = [EngineResult("ours", "ours", figures={"p1_output_tok_s": 300.0, "p2_median_tpot_ms": 8.0}),
               EngineResult("a", "peer a", figures={"p1_output_tok_s": 200.0, "p2_median_tpot_ms": 16.0}),
               EngineResult("b", "peer b", figures={"p1_output_tok_s": 100.0, "p2_median_tpot_ms": 10.0}),
               EngineResult("c", "peer c", status="install failed: x")]
    rows = {r[0]: r for r in _table_rows(format_table(results))}
    ratio = rows["ours / best peer"]
    assert ratio[1] == "1.50x"           # throughput: against the fastest peer (200)
    assert ratio[3] == "- / 0.80x"       # TPOT: against the lowest peer TPOT (10 ms); TTFT unmeasured
    assert rows["peer c"][-1] == "install failed: x"
    assert not any(h.startswith("P4") for h in _table_rows(format_table(results))[0])  # not measured: not shown
    results[0].figures.update(p4_output_tok_s=60.0, p4_8k_median_tpot_ms=9.0)
    results[1].figures.update(p4_output_tok_s=40.0, p4_8k_median_tpot_ms=12.0)
    rows = {r[0]: r for r in _table_rows(format_table(results))}
    assert rows["engine"][-3:-1] == ["P4 tok/s / TTFT / TPOT (ms)", "P4-8k TTFT / TPOT (ms)"]
    assert rows["ours / best peer"][-3:-1] == ["1.50x / - / -", "- / 0.75x"]


def test_bad_options_name_the_valid_values(cp):
    with pytest.raises(ValueError, match="--peers.*ours, vllm, llamacpp"):
        cp.parse_options(["--peers", "ours,tgi"])
    with pytest.raises(ValueError, match="--workloads.*P1, P2, P3, P4, P4-8k"):
        cp.parse_options(["--workloads", "P5"])
    with pytest.raises(ValueError, match="--num-prompts-scale"):
        cp.parse_options(["--num-prompts-scale", "0"])


def test_vllm_metadata_stub_is_a_distribution_named_vllm(cp, tmp_path):
    from peers.install import write_vllm_metadata_stub

    write_vllm_metadata_stub(str(tmp_path), "0.32.0+cpu")
    (dist,) = list(importlib.metadata.distributions(path=[str(tmp_path)]))
    assert dist.metadata["Name"] == "vllm" and dist.version == "0.32.0+cpu"


def test_openvino_peer_export_options(cp, tmp_path):
    """OpenVINO's int4 export needs a group size dividing the hidden size (576 for the bundled model: 64), and
    only the formats optimum-intel offers for our precisions are accepted."""
    from peers.openvino_peer import exported_model, group_size

    assert (group_size(4096), group_size(576), group_size(48)) == (128, 64, 32)
    with pytest.raises(ValueError, match="weight format 'bf16': valid fp16, int8, int4"):
        exported_model({"models_dir": str(tmp_path)}, str(tmp_path), "bf16", str(tmp_path / "log"))


def test_the_vllm_avx2_peer_loads_vllms_avx2_library_with_its_own_dtype(cp, tmp_path):
    """vLLM CPU picks _C_AVX2 only where torch says the CPU has no AVX-512: the peer's sitecustomize says so
    in every process of that server (checked in a fresh interpreter with the peer's environment)."""
    opts = cp.parse_options(["--peers", "vllm-avx2", "--model", str(tmp_path)])  # an HF folder: no conversion
    spec = cp.PEERS["vllm-avx2"].spec({"vllm": "vllm", "models_dir": str(tmp_path)}, opts)
    assert "--dtype" not in spec.argv and spec.argv[:3] == ["vllm", "serve", str(tmp_path)]
    assert spec.env["ATEN_CPU_CAPABILITY"] == "avx2" and spec.env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert "VLLM_NEURON_CPU_ISA" not in spec.env and spec.env["VLLM_CPU_KVCACHE_SPACE"]
    probe = "import torch; print(torch.cpu._is_avx512_supported(), torch.cpu._is_avx512_bf16_supported())"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **spec.env}, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["False", "False"]
