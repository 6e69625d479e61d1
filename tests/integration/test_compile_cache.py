"""The persistent compile cache through `vllm-neuron compile` (native route, not eager).

A 1-layer tiny Llama with one prefill and one decode size keeps the graphs few; every run is a
subprocess, as in production, with NEURON_COMPILED_ARTIFACTS pointing at a temporary folder.
What is checked is what the user reads: the "compile cache DIR: X graphs, Y compiled now, Z
already cached" summary and the per-bucket "compile cache hit" / "compile cache miss" log lines.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

import pytest

from tests.integration.server_utils import run_cli
from tests.model_factory import make_tiny_llama

pytestmark = [pytest.mark.engine, pytest.mark.slow]

_SUMMARY_RE = re.compile(r"compile cache (\S+): (\d+) graphs, (\d+) compiled now, (\d+) already cached")
_BUCKET_RE = re.compile(r"Bucket (\w+): compile cache (hit|miss)")


def _args(num_seqs_buckets: tuple[int, ...], blocks_override: bool = True) -> list[str]:
    neuron = {"num_batched_tokens_buckets": [32], "num_seqs_buckets": list(num_seqs_buckets)}
    return ["--additional-config", json.dumps({"neuron_config": neuron}), "--max-num-batched-tokens", "32",
            "--max-num-seqs", "2", "--max-model-len", "128", "--no-enable-prefix-caching",
            *(["--num-gpu-blocks-override", "16"] if blocks_override else [])]


@dataclass
class CompileRun:
    proc: subprocess.CompletedProcess
    cache_dir: str
    graphs: int
    compiled: int
    cached: int
    buckets: dict[str, str]  # bucket name -> "hit" | "miss"

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr


def _compile(model: str, root: str, tmp_dir: str, num_seqs_buckets: tuple[int, ...] = (2,),
             blocks_override: bool = True, expect_ok: bool = True, **env: str) -> CompileRun:
    proc = run_cli(["compile", model, *_args(num_seqs_buckets, blocks_override)], tmp_dir, timeout=300,
                   NEURON_COMPILED_ARTIFACTS=root, **env)
    out = proc.stdout + proc.stderr
    if not expect_ok:
        assert proc.returncode != 0, out
        return CompileRun(proc, "", 0, 0, 0, {})
    assert proc.returncode == 0, out
    m = _SUMMARY_RE.search(proc.stdout)
    assert m, f"no compile cache summary line:\n{out}"
    buckets = dict(_BUCKET_RE.findall(out))
    return CompileRun(proc, m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)), buckets)


def _snapshot(folder: str) -> dict[str, tuple[int, int]]:
    """path -> (size, mtime_ns) of every file under `folder`."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            st = os.stat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), folder)] = (st.st_size, st.st_mtime_ns)
    return out


def _key_diff(dir_a: str, dir_b: str) -> dict[str, tuple]:
    """The cache-key parts (key.json) that differ; "code" differs when the package's model/worker
    sources were edited between the runs."""
    a, b = (json.loads(open(os.path.join(d, "key.json")).read()) for d in (dir_a, dir_b))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny1")), num_hidden_layers=1)


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("compiled_artifacts"))


@pytest.fixture(scope="module")
def cold_then_warm(model, cache_root, tmp_path_factory) -> tuple[CompileRun, CompileRun]:
    """The warm run with VLLM_NEURON_DISABLE_WARMUP_COMPILE=1: a warm cache serves without compiling (a
    miss would be fatal; the flag changes nothing on a hit, which other tests reach without it)."""
    tmp = str(tmp_path_factory.mktemp("runs"))
    return _compile(model, cache_root, tmp), _compile(model, cache_root, tmp, VLLM_NEURON_DISABLE_WARMUP_COMPILE="1")


@pytest.fixture
def new_root(cold_then_warm, cache_root, tmp_path) -> str:
    """A compile cache root with no graph of ours, with the module's inductor cache at hand (content-addressed,
    shared by every model under a root, or the suite's VLLM_NEURON_INDUCTOR_CACHE_DIR): what a machine that
    compiled before has. The cold run above is the one that fills inductor's cache from nothing."""
    root = tmp_path / "cache"
    if os.environ.get("VLLM_NEURON_INDUCTOR_CACHE_DIR"):  # the suite's shared inductor cache stands in for it
        root.mkdir()
    else:
        shutil.copytree(os.path.join(cache_root, "inductor"), root / "inductor")
    return str(root)


def test_second_compile_is_served_by_the_cache(cold_then_warm, cache_root):
    cold, warm = cold_then_warm
    assert cold.graphs >= 2 and cold.compiled == cold.graphs and cold.cached == 0, cold.output
    assert set(cold.buckets.values()) == {"miss"} and len(cold.buckets) == cold.graphs, cold.output
    assert {"prefill_s32", "decode_b2"} <= set(cold.buckets), cold.output
    assert os.path.dirname(cold.cache_dir) == cache_root

    assert warm.cache_dir == cold.cache_dir, f"the cache key changed: {_key_diff(cold.cache_dir, warm.cache_dir)}"
    assert warm.graphs == cold.graphs and warm.compiled == 0 and warm.cached == cold.graphs, warm.output
    assert warm.buckets == {name: "hit" for name in cold.buckets}, warm.output


def test_missing_bucket_is_fatal_with_warmup_compile_disabled(model, tmp_path):
    empty = tmp_path / "empty_cache"
    proc = run_cli(["compile", model, *_args((2,))], str(tmp_path), timeout=120,
                   NEURON_COMPILED_ARTIFACTS=str(empty), VLLM_NEURON_DISABLE_WARMUP_COMPILE="1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert not _SUMMARY_RE.search(out), out
    error = [line for line in out.splitlines() if "VLLM_NEURON_DISABLE_WARMUP_COMPILE" in line]
    assert error, out
    assert any(re.search(r"\b(prefill_s32|decode_b2)\w*\b", line) for line in error), out


def test_disable_compile_cache_recompiles(cold_then_warm, model, cache_root, tmp_path):
    cold, _ = cold_then_warm
    before = _snapshot(cache_root)
    # TMPDIR: the throw-away cache is a temporary folder that the run leaves behind.
    run = _compile(model, cache_root, str(tmp_path), NEURON_LIBTORCH_DISABLE_COMPILE_CACHE="1", TMPDIR=str(tmp_path))
    assert run.graphs == cold.graphs and run.compiled == cold.graphs and run.cached == 0, run.output
    assert run.buckets == {name: "miss" for name in cold.buckets}, run.output
    # A throw-away cache: the shared one is neither read nor written.
    assert _snapshot(cache_root) == before


def test_changed_bucket_list_compiles_only_the_new_bucket(cold_then_warm, model, cache_root, tmp_path):
    cold, _ = cold_then_warm
    run = _compile(model, cache_root, str(tmp_path), num_seqs_buckets=(1, 2))
    assert run.cache_dir == cold.cache_dir, f"the cache key changed: {_key_diff(cold.cache_dir, run.cache_dir)}"
    assert run.graphs == cold.graphs + 1 and run.compiled == 1 and run.cached == cold.graphs, run.output
    assert run.buckets == {**{name: "hit" for name in cold.buckets}, "decode_b1": "miss"}, run.output


def test_cold_run_saves_each_graph_and_warm_run_loads_it(cold_then_warm):
    cold, warm = cold_then_warm
    for name in cold.buckets:
        assert os.path.getsize(os.path.join(cold.cache_dir, "aot", f"{name}.bin")) > 0
    assert "compiled and saved" in cold.output, cold.output
    # Loaded, not re-traced by dynamo: the point of the saved graphs (warm start).
    loaded = re.findall(r"Bucket (\w+): compile cache hit, loaded the saved graph", warm.output)
    assert sorted(loaded) == sorted(cold.buckets), warm.output


def test_unreadable_saved_graph_is_compiled_again(cold_then_warm, model, cache_root, tmp_path):
    cold, _ = cold_then_warm
    root = tmp_path / "copy"
    shutil.copytree(cache_root, root)
    bad = root / os.path.basename(cold.cache_dir) / "aot" / "decode_b2.bin"
    bad.write_bytes(bad.read_bytes()[:100])  # truncated
    run = _compile(model, str(root), str(tmp_path))
    assert "Bucket decode_b2: cannot load" in run.output, run.output
    assert run.buckets["decode_b2"] == "miss" and run.compiled == 1, run.output
    assert os.path.getsize(bad) > 100  # saved again
    again = _compile(model, str(root), str(tmp_path))
    assert again.compiled == 0, again.output


def test_aot_off_traces_with_torch_compile(cold_then_warm, model, cache_root, tmp_path):
    cold, _ = cold_then_warm
    run = _compile(model, cache_root, str(tmp_path), VLLM_NEURON_AOT_COMPILE="0")
    assert run.graphs == cold.graphs, run.output
    assert "loaded the saved graph" not in run.output and "saved" not in run.output.split("compile cache /")[0], \
        run.output


def test_loaded_graphs_generate_what_eager_generates(model, new_root, tmp_path):
    """Greedy fp32 text is the same from freshly compiled graphs, from graphs loaded from the cache and
    uncompiled."""
    root = new_root
    prompts = ["hello world", "a b c d e f g h i j k l m n o p q r s t u v", "x"]

    def generate(*extra: str, **env: str) -> str:
        proc = run_cli(["generate", "--model", model, "--raw", "--max-tokens", "12", "--temperature", "0",
                        "--dtype", "float32",
                        *_args((2,)), *extra, *prompts],
                       str(tmp_path), timeout=300, NEURON_COMPILED_ARTIFACTS=root, **env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout.split(">>> ", 1)[1]

    cold = generate()
    warm = generate(VLLM_NEURON_DISABLE_WARMUP_COMPILE="1")
    eager = generate("--enforce-eager")
    assert cold == warm, (cold, warm)
    assert warm == eager, (warm, eager)
    # Same bucket names, other input shapes (a wider block table): the saved graphs must not be reused.
    wider = ("--max-model-len", "256")
    proc = run_cli(["generate", "-v", "--model", model, "--raw", "--max-tokens", "12", "--temperature", "0",
                    "--dtype", "float32",
                    *_args((2,)), *wider, *prompts], str(tmp_path), timeout=300, NEURON_COMPILED_ARTIFACTS=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "compiled for other input shapes" in proc.stdout + proc.stderr
    assert proc.stdout.split(">>> ", 1)[1] == generate("--enforce-eager", *wider)


_FAKE_MEMORY = """
import os
gib = os.environ.get("TEST_FAKE_HOST_AVAILABLE_GIB")
if gib:  # the host's available memory as this test says, whatever the machine has
    from vllm_neuron.worker import memory
    memory.host_available_bytes = lambda meminfo_path=None: int(float(gib) * (1 << 30))
"""


def test_kv_pool_and_graphs_survive_a_restart_with_less_free_memory(model, new_root, tmp_path):
    """The KV pool is sized from host memory (no override) on the first start; a restart with half the
    free memory reuses it and loads every saved graph; with far less, start-up is refused with the
    arithmetic instead of shrinking the pool and recompiling."""
    fake = tmp_path / "fake_memory"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(_FAKE_MEMORY)
    root = new_root
    env = {"PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "VLLM_NEURON_MIN_KV_BUDGET_GIB": "0"}

    def start(gib: float, **kw) -> CompileRun:
        return _compile(model, root, str(tmp_path), blocks_override=False, TEST_FAKE_HOST_AVAILABLE_GIB=str(gib),
                        **env, **kw)

    cold = start(1.0)
    blocks = json.loads(open(os.path.join(cold.cache_dir, "manifest.json")).read())["num_blocks"]
    assert "first start with this configuration" in cold.output and cold.compiled == cold.graphs, cold.output
    warm = start(0.5)  # the budget alone would now size half the pool
    assert warm.cache_dir == cold.cache_dir and warm.compiled == 0 and warm.cached == cold.graphs, warm.output
    assert f"KV pool: {blocks} blocks" in warm.output and "reused whatever the free memory" in warm.output
    refused = start(0.1, expect_ok=False)
    assert "no longer fits in memory" in refused.output and f"{blocks} blocks" in refused.output, refused.output
    assert "num_gpu_blocks_override (at most" in refused.output, refused.output


def test_parallel_workers_save_the_graphs_one_process_saves(cold_then_warm, model, cache_root, new_root, tmp_path):
    """NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS=2: two worker processes compile the buckets into the cache,
    then the engine loads every saved graph without re-tracing. The saved graphs (names, input signatures)
    are those the one-process cold run saved, and both caches generate the same greedy text."""
    cold, _ = cold_then_warm
    root = new_root
    run = _compile(model, root, str(tmp_path), NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS="2")
    assert run.cache_dir == os.path.join(root, os.path.basename(cold.cache_dir)), run.output  # the same key
    workers = dict(re.findall(r"Bucket (\w+): compiled in worker (\d+)", run.output))
    assert set(workers) == set(cold.buckets) and len(set(workers.values())) == 2, run.output  # both took one
    engine_log = run.output.split(f"Parallel compilation of {len(cold.buckets)} buckets done", 1)[1]
    loaded = re.findall(r"Bucket (\w+): compile cache hit, loaded the saved graph", engine_log)
    assert sorted(loaded) == sorted(cold.buckets) and "compile cache miss" not in engine_log, run.output

    def saved(key_dir: str) -> dict[str, str]:
        """Saved graph of each cold bucket -> the input signature it was compiled for."""
        aot = os.path.join(key_dir, "aot")
        assert set(cold.buckets) <= {f[:-4] for f in os.listdir(aot) if f.endswith(".bin")}
        return {b: open(os.path.join(aot, b + ".inputs")).read() for b in cold.buckets}

    # The module's cold cache may also hold graphs that earlier tests added (a changed bucket list);
    # the parallel run's own cache holds exactly the cold buckets.
    assert sorted(f[:-4] for f in os.listdir(os.path.join(run.cache_dir, "aot")) if f.endswith(".bin")) == \
        sorted(cold.buckets)
    assert saved(run.cache_dir) == saved(cold.cache_dir)

    def generate(cache: str) -> str:
        proc = run_cli(["generate", "--model", model, "--raw", "--max-tokens", "12", "--temperature", "0", *_args((2,)),
                        "hello world", "a b c d e f g h i j k l m n o p q r s t u v"], str(tmp_path), timeout=300,
                       NEURON_COMPILED_ARTIFACTS=cache, VLLM_NEURON_DISABLE_WARMUP_COMPILE="1")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout.split(">>> ", 1)[1]

    assert generate(root) == generate(cache_root)


def test_parallel_worker_timeout_names_the_bucket(model, tmp_path):
    proc = run_cli(["compile", model, *_args((1, 2))], str(tmp_path), timeout=300,
                   NEURON_COMPILED_ARTIFACTS=str(tmp_path / "cache"), NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS="2",
                   NEURON_LIBTORCH_COMPILATION_TIMEOUT="1")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    # Raised in the worker (CompileTimeout), or the worker killed by this process when its timer could not fire.
    assert re.search(r"Parallel compilation failed: bucket (prefill_s32|decode_b1|decode_b2): (CompileTimeout: "
                     r"Bucket \1: )?compilation took longer than NEURON_LIBTORCH_COMPILATION_TIMEOUT=1 s", out), out
