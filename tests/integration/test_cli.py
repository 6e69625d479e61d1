"""The `vllm-neuron` command as a user runs it: offline generation, help, and bad options that must
fail fast with a message naming the problem (never a traceback, never a hang, never a download)."""
from __future__ import annotations

import pytest

import json
import re
import socket
import subprocess
import time


from tests.integration.server_utils import ServerProcess, run_cli

_SMALL_KV = ["--max-model-len", "512", "--num-gpu-blocks-override", "4"]


def _output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


def _assert_clean_failure(proc: subprocess.CompletedProcess, *needles: str) -> str:
    out = _output(proc)
    assert proc.returncode != 0, out
    assert "Traceback" not in out, out
    for needle in needles:
        assert needle in out, out
    return out


_LOG_LINE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d ", re.MULTILINE)


@pytest.mark.engine
def test_generate_stdout_holds_only_the_answer(tiny_llama_dir, tmp_path):
    """A command-line tool's streams: the answer alone on stdout, the log on stderr (-v for all of it), so that
    `vllm-neuron generate ... > answer.txt` captures the answer and nothing else."""
    from transformers import AutoTokenizer

    base = ["generate", "--model", tiny_llama_dir, "--enforce-eager", "--max-tokens", "5", "--temperature", "0"]
    quiet = run_cli(base + ["hello"], str(tmp_path), timeout=120, VLLM_NEURON_LOG_LEVEL="")
    verbose = run_cli(base + ["-v", "hello"], str(tmp_path), timeout=120, VLLM_NEURON_LOG_LEVEL="")
    for proc in (quiet, verbose):
        assert proc.returncode == 0, _output(proc)
        assert not _LOG_LINE.search(proc.stdout), proc.stdout
    # Greedy: the same answer both times, so nothing of the verbose run's log reached its stdout.
    assert quiet.stdout == verbose.stdout and quiet.stdout.endswith("\n"), (quiet.stdout, verbose.stdout)
    answer = quiet.stdout[:-1]
    n = len(AutoTokenizer.from_pretrained(tiny_llama_dir).encode(answer, add_special_tokens=False))
    assert 1 <= n <= 6, f"{n} tokens for --max-tokens 5: {answer!r}"  # +1: a space may re-tokenize apart
    assert not _LOG_LINE.search(quiet.stderr), quiet.stderr  # warnings only, and this run has none
    assert "INFO" in verbose.stderr and "Engine" in verbose.stderr, verbose.stderr


def test_serve_help(tmp_path):
    proc = run_cli(["serve", "--help"], str(tmp_path), timeout=60)
    assert proc.returncode == 0, _output(proc)
    for flag in ("--max-model-len", "--additional-config", "--api-key", "--port"):
        assert flag in proc.stdout, flag


def test_port_in_use_fails_before_loading(tmp_path):
    """The port is checked before anything loads (here the bundled model, seconds to load): the failure comes
    as fast as `serve --help` (the same imports and parser) and says what to do."""
    t0 = time.monotonic()
    proc = run_cli(["serve", "--help"], str(tmp_path), timeout=60)
    reference = time.monotonic() - t0
    assert proc.returncode == 0, _output(proc)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        proc = run_cli(["serve", "--port", str(port)], str(tmp_path), timeout=60)
        seconds = time.monotonic() - t0
    _assert_clean_failure(proc, f"port {port} is in use: pass --port")
    assert seconds < max(2.0, reference + 1.0), f"{seconds:.1f} s (serve --help: {reference:.1f} s)"


def test_unknown_neuron_config_key_is_named(tiny_llama_dir, tmp_path):
    proc = run_cli(["serve", tiny_llama_dir, "--enforce-eager", "--additional-config",
                    json.dumps({"neuron_config": {"bogus": 1}})], str(tmp_path), timeout=60)
    out = _assert_clean_failure(proc, "bogus")
    assert "num_seqs_buckets" in out, "the message should list the valid keys"


def test_ep_degree_without_expert_parallel_fails_at_startup(tiny_llama_dir, tmp_path):
    """The seeds' "Server fails with 'ep_degree requires --enable-expert-parallel'"."""
    proc = run_cli(["serve", tiny_llama_dir, "--enforce-eager", "--tensor-parallel-size", "2", "--additional-config",
                    json.dumps({"neuron_config": {"ep_degree": 2}})], str(tmp_path), timeout=60)
    _assert_clean_failure(proc, "ep_degree requires --enable-expert-parallel")


def test_hub_model_without_a_reachable_hub_is_one_clean_error(tmp_path):
    """A model by id is downloaded (tests/integration/test_hub_models.py); with no hub to reach and nothing cached,
    serve stops with one line saying so."""
    name = "meta-llama/Llama-3.2-1B-Instruct"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once the socket is closed
    proc = run_cli(["serve", name, "--enforce-eager", "--download-dir", str(tmp_path / "hub")], str(tmp_path),
                   timeout=60, HF_ENDPOINT=dead)
    _assert_clean_failure(proc, name, "cannot be reached", "check the network and HF_ENDPOINT")


@pytest.mark.engine
def test_too_few_kv_blocks_offline(tiny_llama_dir, tmp_path):
    proc = run_cli(["generate", "--model", tiny_llama_dir, "--enforce-eager", *_SMALL_KV, "hello"], str(tmp_path),
                   timeout=120)
    _assert_clean_failure(proc, "num_gpu_blocks_override", "max_model_len")


@pytest.mark.engine
def test_too_few_kv_blocks_serve_exits(tiny_llama_dir, tmp_path):
    # TMPDIR: the server is killed below, and its IPC folder would be left in /tmp.
    srv = ServerProcess(tiny_llama_dir, ["--enforce-eager", *_SMALL_KV], str(tmp_path), TMPDIR=str(tmp_path))
    try:
        deadline = time.monotonic() + 90
        while srv.proc.poll() is None and "EngineCore is dead" not in srv.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        try:
            srv.proc.wait(10)  # grace after the engine reported its death
        except subprocess.TimeoutExpired:
            pass
        out = srv.log()
        assert srv.proc.returncode not in (None, 0), f"server still running after its engine died:\n{out}"
        assert "num_gpu_blocks_override" in out and "max_model_len" in out, out
    finally:
        srv.kill()
