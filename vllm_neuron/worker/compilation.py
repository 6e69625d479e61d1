"""One compiled graph per bucket, and the persistent compile cache.

Graphs are compiled with torch.compile on static shapes (the "native route"); `eager` runs the same
functions uncompiled. The cache has two layers:
* inductor's own content-addressed cache, shared by every model under `<cache root>/inductor` (or
  `VLLM_NEURON_INDUCTOR_CACHE_DIR`) so the costly first-compile setup happens once per machine. Under
  aot_compile torch keys each graph by a fresh id, so what it shares is the compiled C++ kernels
  and headers (half of a graph's compile time on CPU), not whole graphs;
* a manifest per cache key `<cache root>/<key>/manifest.json` recording which buckets were compiled.
  The key covers what the seeds list under "What triggers recompilation": library versions, the
  model's config and our model code, bucket-independent graph options, dtype, device type and TP
  degree, plus the host the code was generated for (CPU instruction set, C++ compiler; GPU model), so a
  cache on shared storage is never run on a machine it was not built for.
  `VLLM_NEURON_DISABLE_WARMUP_COMPILE=1` makes a bucket missing from the manifest fatal.
Each bucket's graph is compiled ahead of time (`torch.compile(...).aot_compile`) and saved as
`<key>/aot/<bucket>.bin`: dynamo's bytecode, guards and the compiled inductor graph, without weights. A
warm start loads that file instead of re-tracing the model with dynamo, which is what made warm starts
slow (about 1.5 s per graph traced, against 0.1-0.3 s loaded). Where ahead-of-time compilation is
unavailable (disabled cache, `VLLM_NEURON_AOT_COMPILE=0`, or a failure) the bucket is compiled with plain
torch.compile and inductor's cache alone speeds up its next start. A torch without `aot_compile` (torch
2.11 on CUDA) saves what it offers instead: `torch.compiler.save_cache_artifacts()` after warm-up into
`<key>/cache_artifacts.bin`, loaded at the next start (graphs are re-traced, their compiled code is
not rebuilt). The log says which path runs.
`NEURON_LIBTORCH_COMPILATION_TIMEOUT` bounds each bucket's compilation (warm-up fails naming the
bucket); `NEURON_LIBTORCH_PARALLEL_COMPILE_WORKERS` > 1 compiles the missing buckets in that many
processes first (worker/parallel_compile.py), whose saved graphs warm-up then loads; `NEURON_LIBTORCH_REMOTE_CACHE` is a shared folder: buckets missing locally are taken from
`<remote>/<key>/` before compiling, and what warm-up compiled is published there.
Every shape is static, the KV cache's included: a dynamic slot dimension makes inductor copy the
whole cache on every in-place write (24 ms per layer and step measured). So the manifest also records
the KV size it was compiled for and the sizing configuration that chose it; worker/memory.py's
`plan_kv_pool` reuses that size on a restart whatever the free memory (or refuses with the arithmetic
when it no longer fits).
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree

from vllm_neuron import envs
from vllm_neuron.config.device import compiler_id, cpu_isa
from vllm_neuron.logger import init_logger
from vllm_neuron.model.layer_region import inlined_layers

logger = init_logger(__name__)

_PKG_ROOT = Path(__file__).resolve().parent.parent
# Code that shapes the traced graphs: a change here must invalidate the manifest. Checkpoint loading
# is not part of a graph (its output, the model config, is in the key on its own).
_GRAPH_CODE_DIRS = ("model", "worker")
_NOT_GRAPH_CODE = ("model/loader/",)


def _code_fingerprint() -> str:
    h = hashlib.sha256()
    for sub in _GRAPH_CODE_DIRS:
        for path in sorted(p for ext in ("*.py", "*.cpp") for p in (_PKG_ROOT / sub).rglob(ext)
                           if not p.relative_to(_PKG_ROOT).as_posix().startswith(_NOT_GRAPH_CODE)):
            h.update(path.relative_to(_PKG_ROOT).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def host_key(device: torch.device) -> dict[str, Any]:
    """What the generated code depends on beyond the libraries: the CPU's instruction set and the C++
    compiler inductor builds CPU graphs with; on CUDA the GPU model and compute capability."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return {"gpu": torch.cuda.get_device_name(index), "capability": list(torch.cuda.get_device_capability(index)),
                "cuda": torch.version.cuda}
    from torch._inductor import cpp_builder

    return {"cpu_isa": cpu_isa(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cxx": compiler_id(cpp_builder.get_cpp_compiler()), "cxxflags": os.environ.get("CXXFLAGS", "")}


def cache_key_parts(hf_config_dict: dict, dtype: torch.dtype, device: torch.device, tp_size: int,
                    graph_options: dict) -> dict[str, Any]:
    import transformers

    from vllm_neuron.version import __version__

    config = {k: v for k, v in hf_config_dict.items() if k not in ("_name_or_path", "transformers_version")}
    return {
        "vllm_neuron": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "code": _code_fingerprint(),
        "model_config": config,
        "dtype": str(dtype),
        "device_type": device.type,
        "tp_size": tp_size,
        "graph_options": graph_options,
        "host": host_key(device),
    }


def aot_compile_available() -> bool:
    """Whether this torch saves compiled functions ahead of time (`torch.compile(...).aot_compile`; torch
    2.11 on CUDA has none)."""
    return (callable(getattr(torch.compile(_identity), "aot_compile", None))
            and hasattr(torch.compiler, "load_compiled_function"))


def _identity(x):
    return x


# Inductor checks every input's sizes and strides on every call (412 checks in a decode step of the bundled
# model: ~20 inputs of each decoder layer's region, 30 layers). A bucket's shapes are static and its inputs
# come from the runner's own buffers, so the checks can never fire; dynamo's tensor guards still run where
# they are kept.
#
# Inductor runs an elementwise kernel in an OpenMP parallel region from 512 elements per thread on: at
# decode sizes (SiLU over 1,536 values) the fork and join cost more than the work, and when another process
# holds a core (the API server tokenizing, detokenizing) the join waits for it - 0.38 ms per such kernel on
# average, 150 of them a step, measured while the machine was busy. From 32K elements per thread only
# prefill-sized kernels go parallel; the matmuls and attention keep both cores through their own loops.
INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False, "scalar_asserts": False,
                    "cpp.min_chunk_size": 32768}


class CompileTimeout(RuntimeError):
    pass


def _timeout_message(name: str, seconds: int | None) -> str:
    return (f"Bucket {name}: compilation took longer than NEURON_LIBTORCH_COMPILATION_TIMEOUT={seconds} s; raise "
            "the timeout, or compile it once with `vllm-neuron compile`")


def _compile_timeout(e: BaseException, name: str, seconds: int | None) -> CompileTimeout | None:
    """The CompileTimeout behind `e`: dynamo wraps an exception raised while it traces (the timer's signal
    lands anywhere) in its own errors, sometimes keeping only its text."""
    first, seen = e, set()
    while e is not None and id(e) not in seen:
        if isinstance(e, CompileTimeout):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    if seconds is not None and "NEURON_LIBTORCH_COMPILATION_TIMEOUT=" in str(first):
        return CompileTimeout(_timeout_message(name, seconds))
    return None


@contextlib.contextmanager
def _deadline(name: str, seconds: int | None):
    """Raises CompileTimeout when the block runs longer than `seconds` (None: no limit). A signal timer:
    compilation is Python code and subprocess waits, which a signal interrupts. The timer repeats every 0.1 s
    once expired: inductor catches every exception in places (an ISA probe's `except Exception`, cache lookups),
    and a single signal landing there was lost, the compile running on to its end."""
    if seconds is None:
        yield
        return

    def expired(signum, frame):
        raise CompileTimeout(_timeout_message(name, seconds))

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds, 0.1)
    try:
        yield
    finally:
        # A repeat may land here too: disarm until it sticks, or the timer would outlive the block (the caller
        # still learns of an overrun: warm() checks the time).
        while True:
            try:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, previous)
                break
            except CompileTimeout:
                continue


@dataclass
class BucketCompileRecord:
    name: str
    seconds: float
    cache_hit: bool


@dataclass
class GraphCompiler:
    """Compiles graph functions and keeps the manifest of compiled buckets."""

    key_parts: dict[str, Any]
    backend: str = "native"  # "native" (torch.compile) or "eager"
    root: str = field(default_factory=envs.compile_cache_dir)
    records: list[BucketCompileRecord] = field(default_factory=list)
    # Decode graphs (config/buckets.py's decode_b*) get inductor's C++ wrapper (neuron_config.decode_cpp_wrapper).
    decode_cpp_wrapper: bool = False
    # Every graph traces its layers inlined (tensor capture / replacement hooks inside a layer cannot run in a
    # nested compile region, which must be free of side effects).
    inline_layers: bool = False

    def __post_init__(self) -> None:
        blob = json.dumps(self.key_parts, sort_keys=True, default=str).encode()
        self.key = hashlib.sha256(blob).hexdigest()[:20]
        self.disabled = bool(envs.NEURON_LIBTORCH_DISABLE_COMPILE_CACHE)
        self.fail_on_miss = bool(envs.VLLM_NEURON_DISABLE_WARMUP_COMPILE)
        if self.disabled:
            # A private, throw-away cache: nothing is read from or left in the shared one.
            self.dir = Path(tempfile.mkdtemp(prefix="vllm_neuron_nocache_"))
            inductor_dir = self.dir / "inductor"
        else:
            self.dir = Path(self.root) / self.key
            shared = envs.VLLM_NEURON_INDUCTOR_CACHE_DIR
            inductor_dir = Path(os.path.expanduser(shared)).absolute() if shared else Path(self.root) / "inductor"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest_path = self.dir / "manifest.json"
        self.manifest: dict[str, Any] = {}
        self.manifest_num_blocks: int | None = None
        self.manifest_kv_sizing: dict[str, Any] | None = None
        if not self.disabled and self.manifest_path.exists():
            saved = json.loads(self.manifest_path.read_text())
            self.manifest = saved.get("buckets", {})
            self.manifest_num_blocks = saved.get("num_blocks")
            self.manifest_kv_sizing = saved.get("kv_sizing")
        self.num_blocks: int | None = None
        self.kv_sizing: dict[str, Any] | None = None
        self.writes_manifest = True  # False in a parallel compile worker: the engine's process records
        self._source: str | None = None  # how the last bucket materialized: loaded / compiled / traced
        self.timeout = envs.NEURON_LIBTORCH_COMPILATION_TIMEOUT
        if self.timeout is not None and self.backend == "native" \
                and threading.current_thread() is not threading.main_thread():
            raise ValueError("NEURON_LIBTORCH_COMPILATION_TIMEOUT needs warm-up on the process's main thread "
                             "(it interrupts compilation with a signal); unset it, or start the engine from the "
                             "main thread")
        self.aot = (self.backend == "native" and not self.disabled and bool(envs.VLLM_NEURON_AOT_COMPILE)
                    and aot_compile_available())
        # torch without aot_compile: its portable cache artifacts stand in for the saved graphs.
        self.artifacts = (self.backend == "native" and not self.disabled and not self.aot
                          and bool(envs.VLLM_NEURON_AOT_COMPILE))
        remote = envs.NEURON_LIBTORCH_REMOTE_CACHE
        self.remote_dir = Path(remote) / self.key if remote and not self.disabled and self.backend == "native" \
            else None
        if self.backend == "native":
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
            import torch._dynamo

            # One entry per bucket under one code object: lift dynamo's recompile cap accordingly.
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 512)
            torch._dynamo.config.accumulated_cache_size_limit = max(
                torch._dynamo.config.accumulated_cache_size_limit, 4096)
            torch._dynamo.config.automatic_dynamic_shapes = False
            if self.disabled:
                torch._inductor.config.force_disable_caches = True
        _write_text_atomic(self.dir / "key.json", json.dumps(self.key_parts, indent=1, sort_keys=True, default=str))
        if self.remote_dir is not None:
            self._pull()
        if self.backend == "native":
            logger.info("Compile cache path: %s", (
                "saved ahead-of-time graphs (torch.compile aot_compile)" if self.aot else
                "torch.compiler cache artifacts (this torch has no aot_compile: graphs are re-traced on each "
                "start, their compiled code is loaded)" if self.artifacts else
                "inductor's cache only (graphs are re-traced on each start)"))
        if self.artifacts and self._artifacts_path.exists():
            try:
                torch.compiler.load_cache_artifacts(self._artifacts_path.read_bytes())
                logger.info("Loaded torch.compiler cache artifacts from %s", self._artifacts_path)
            except Exception as e:  # noqa: BLE001 - another torch's artifacts: compile as if cold
                logger.warning("Cannot load %s (%s: %s); compiling cold", self._artifacts_path, type(e).__name__, e)

    @property
    def _artifacts_path(self) -> Path:
        return self.dir / "cache_artifacts.bin"

    def _files(self, name: str) -> list[Path]:
        """A bucket's saved files, relative to the key folder."""
        return [Path("aot") / f"{name}.bin", Path("aot") / f"{name}.inputs"]

    def _pull(self) -> None:
        """Takes from the remote folder what the local cache lacks (buckets of the same KV size)."""
        remote = self.remote_dir
        try:
            saved = json.loads((remote / "manifest.json").read_text())
        except (OSError, ValueError):
            return
        if self.manifest and saved.get("num_blocks") != self.manifest_num_blocks:
            logger.info("Remote compile cache %s holds another KV size (%s blocks, local %s): not used", remote,
                        saved.get("num_blocks"), self.manifest_num_blocks)
            return
        taken = []
        for name, entry in saved.get("buckets", {}).items():
            files = self._files(name)
            if name in self.manifest or not all((remote / f).exists() for f in files):
                continue
            for f in files:
                _copy_atomic(remote / f, self.dir / f)
            self.manifest[name] = entry
            taken.append(name)
        if (remote / "cache_artifacts.bin").exists() and not self._artifacts_path.exists():
            _copy_atomic(remote / "cache_artifacts.bin", self._artifacts_path)
        if taken:
            self.manifest_num_blocks = saved.get("num_blocks")
            logger.info("Remote compile cache %s: took %d saved graphs (%s)", remote, len(taken), ", ".join(taken))

    def _publish(self) -> None:
        """Copies this cache's graphs the remote folder lacks there, then merges the manifests."""
        remote = self.remote_dir
        remote.mkdir(parents=True, exist_ok=True)
        with open(remote / "manifest.lock", "a") as lock:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent publishers merge one after the other
            try:
                saved = json.loads((remote / "manifest.json").read_text())
            except (OSError, ValueError):
                saved = {"key": self.key, "num_blocks": self.num_blocks, "buckets": {}}
            if saved.get("num_blocks") != self.num_blocks:
                logger.info("Remote compile cache %s holds another KV size (%s blocks, here %s): not published",
                            remote, saved.get("num_blocks"), self.num_blocks)
                return
            sent = []
            for name, entry in self.manifest.items():
                files = self._files(name)
                if name in saved["buckets"] or not all((self.dir / f).exists() for f in files):
                    continue
                for f in files:
                    _copy_atomic(self.dir / f, remote / f)
                saved["buckets"][name] = entry
                sent.append(name)
            if self._artifacts_path.exists():
                _copy_atomic(self._artifacts_path, remote / "cache_artifacts.bin")
            _write_text_atomic(remote / "key.json", json.dumps(self.key_parts, indent=1, sort_keys=True, default=str))
            _write_text_atomic(remote / "manifest.json", json.dumps(saved, indent=1, sort_keys=True))
        if sent:
            logger.info("Remote compile cache %s: published %d graphs (%s)", remote, len(sent), ", ".join(sent))

    def finish(self) -> None:
        """After warm-up: saves torch's cache artifacts (no-aot torch) and publishes to the remote folder."""
        if self.backend != "native" or self.disabled:
            return
        if self.artifacts:
            saved = torch.compiler.save_cache_artifacts()
            if saved is not None:
                _write_bytes_atomic(self._artifacts_path, saved[0])
                logger.info("Saved torch.compiler cache artifacts (%.1f MiB) to %s", len(saved[0]) / 2**20,
                            self._artifacts_path)
        if self.remote_dir is not None:
            self._publish()

    def set_num_blocks(self, num_blocks: int, kv_sizing: dict[str, Any] | None = None) -> None:
        """The KV size the graphs are compiled for, and what chose it (recorded with it); a different
        size than the manifest's invalidates it."""
        if self.manifest_num_blocks is not None and self.manifest_num_blocks != num_blocks:
            logger.info("KV cache size changed (%d -> %d blocks): every bucket recompiles",
                        self.manifest_num_blocks, num_blocks)
            self.manifest = {}
        self.num_blocks = num_blocks
        self.kv_sizing = kv_sizing

    def missing(self, names: list[str]) -> list[str]:
        """The buckets warm-up would compile: not in the manifest, or (saved graphs) without their file."""
        if self.backend != "native":
            return []
        return [n for n in names if n not in self.manifest or (self.aot and not self._aot_path(n).exists())]

    def record_compiled(self, seconds: dict[str, float]) -> None:
        """Buckets compiled by parallel workers into this cache (worker/parallel_compile.py)."""
        for name, s in seconds.items():
            self.manifest[name] = {"compile_seconds": round(s, 3), "time": time.time()}
        self._save()

    def bucket(self, name: str, fn: Callable) -> "BucketGraph":
        """The graph of bucket `name` running the bound method `fn` (of an object holding the model)."""
        return BucketGraph(self, name, fn)

    def uses_cpp_wrapper(self, name: str) -> bool:
        return self.decode_cpp_wrapper and self.backend == "native" and name.startswith("decode_b")

    def _options(self, name: str) -> dict[str, Any]:
        # The C++ wrapper calls a step's ~300 kernels and ops without Python in between (tens of us a layer
        # on the bundled model), but cannot call a nested region: its graphs trace the layers inlined, and
        # compile several times slower.
        return {**INDUCTOR_OPTIONS, "cpp_wrapper": True} if self.uses_cpp_wrapper(name) else dict(INDUCTOR_OPTIONS)

    def _aot_path(self, name: str) -> Path:
        return self.dir / "aot" / f"{name}.bin"

    def _materialize(self, name: str, fn: Callable, args: tuple) -> Callable:
        """A callable for bucket `name`: loaded from the cache, else compiled with `args` as the example."""
        if self.backend == "eager":
            return fn
        owner = fn.__self__
        external = {"graphs": owner, "model": owner.model}
        use_aot = self.aot
        path = self._aot_path(name)
        signature = input_signature(args)
        sig_path = path.with_suffix(".inputs")
        loadable = use_aot and name in self.manifest and path.exists()
        if loadable and (not sig_path.exists() or sig_path.read_text() != signature):
            # Shapes not named by the bucket (block-table width from max_model_len, slots from
            # max_num_seqs, ...) changed: the saved graph would read its inputs wrongly.
            logger.info("Bucket %s: the saved graph was compiled for other input shapes; compiling it again", name)
            loadable = False
        if loadable:
            try:
                with open(path, "rb") as f:
                    # The graph function's module globals: its StepOutput class is rebuilt from them.
                    compiled = torch.compiler.load_compiled_function(f, external_data=external,
                                                                     f_globals=fn.__func__.__globals__)
                compiled.disable_guard_check()  # shapes are static per bucket and the key covers the rest
                self._source = "loaded"
                return functools.partial(compiled, owner)
            except Exception as e:  # a cache from another environment, or a truncated file
                logger.warning("Bucket %s: cannot load %s (%s: %s); compiling it again", name, path,
                               type(e).__name__, e)
        if self.fail_on_miss and (use_aot or name not in self.manifest):
            raise RuntimeError(
                f"VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 and bucket {name} is not in the compile cache "
                f"{self.dir} (key {self.key}); run `vllm-neuron compile` with the same configuration first")
        if use_aot:
            try:
                compiled = torch.compile(fn, dynamic=False, fullgraph=True, options={
                    **self._options(name),
                    # The guards are saved with the graph: only tensor guards survive serialization.
                    "guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}).aot_compile((args, {}))
                path.parent.mkdir(parents=True, exist_ok=True)
                # Atomic like its signature: a crash mid-write never leaves a truncated graph to load.
                _write_atomic(path, lambda tmp: compiled.save_compiled_function(tmp, external_data=external))
                _write_text_atomic(sig_path, signature)
                compiled.disable_guard_check()
                self._source = "compiled"
                return functools.partial(compiled, owner)
            except Exception as e:
                timeout = _compile_timeout(e, name, self.timeout)
                if timeout is not None:  # fails warm-up: no unbounded fallback compile
                    raise timeout from None
                logger.warning("Bucket %s: ahead-of-time compilation failed (%s: %s); using torch.compile, "
                               "which re-traces this graph on every start", name, type(e).__name__, e)
        self._source = "traced"
        return torch.compile(fn, dynamic=False, fullgraph=True, options=self._options(name))

    def warm(self, name: str, run: Callable[[], Any]) -> BucketCompileRecord:
        """Runs one bucket's graph once on dummy inputs, compiling it (or loading it from the cache)."""
        in_manifest = name in self.manifest
        from torch._dynamo.utils import counters

        misses0 = counters["inductor"]["fxgraph_cache_miss"]
        self._source = None
        t0 = time.perf_counter()
        with _deadline(name, self.timeout if self.backend == "native" else None):
            run()
        seconds = time.perf_counter() - t0
        if self.backend == "native" and self.timeout is not None and seconds > self.timeout \
                and self._source != "loaded":
            # Every signal swallowed: the compile finished, but past its limit all the same.
            raise CompileTimeout(_timeout_message(name, self.timeout))
        misses = counters["inductor"]["fxgraph_cache_miss"] - misses0
        # A traced bucket counts as a hit when inductor's cache served it; a loaded one always does.
        hit = self.backend == "native" and in_manifest and (
            self._source == "loaded" or (self._source == "traced" and misses == 0))
        rec = BucketCompileRecord(name, seconds, hit)
        self.records.append(rec)
        if self.backend == "native":
            how = {"loaded": "compile cache hit, loaded the saved graph",
                   "traced": "compile cache hit, re-traced (inductor's cache)" if hit else "compile cache miss, compiled",
                   "compiled": "compile cache miss, compiled and saved"}.get(self._source, "compiled")
            logger.info("Bucket %s: %s in %.1f s", name, how, seconds)
            self.manifest[name] = {"compile_seconds": round(seconds, 3), "time": time.time()}
            self._save()
        return rec

    def _save(self) -> None:
        if self.disabled or not self.writes_manifest:
            return
        _write_text_atomic(self.manifest_path, json.dumps(
            {"key": self.key, "num_blocks": self.num_blocks, "kv_sizing": self.kv_sizing, "buckets": self.manifest},
            indent=1, sort_keys=True))

    @property
    def num_compiled(self) -> int:
        """Buckets compiled from scratch in this process (not served by the cache)."""
        return sum(1 for r in self.records if not r.cache_hit) if self.backend == "native" else 0


def _write_atomic(path: Path, write: Callable[[str], None]) -> None:
    """write(tmp) fills a temporary file next to `path`, which then replaces `path` in one step: a
    concurrent start never reads half a file, and a crash leaves the old file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _write_text_atomic(path: Path, text: str) -> None:
    _write_atomic(path, lambda tmp: Path(tmp).write_text(text))


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    _write_atomic(path, lambda tmp: Path(tmp).write_bytes(data))


def _copy_atomic(src: Path, dst: Path) -> None:
    _write_atomic(dst, lambda tmp: shutil.copyfile(src, tmp))


def input_signature(args: tuple) -> str:
    """Dtype, shape and strides of every tensor in `args` (nested lists and tuples included): what a saved
    graph, loaded without guard checks, must be called with."""
    parts = []
    for leaf in torch.utils._pytree.tree_leaves(args):
        if isinstance(leaf, torch.Tensor):
            parts.append(f"{leaf.dtype}{tuple(leaf.shape)}{leaf.stride()}")
        else:
            parts.append(type(leaf).__name__)
    return ";".join(parts)


class BucketGraph:
    """One bucket's graph. It materializes on its first call (warm-up makes that call), because
    ahead-of-time compilation needs example inputs."""

    def __init__(self, compiler: GraphCompiler, name: str, fn: Callable) -> None:
        self.compiler = compiler
        self.name = name
        self.fn = fn
        self._call: Callable | None = None
        self.inline = compiler.inline_layers or compiler.uses_cpp_wrapper(name)

    def __call__(self, *args: Any) -> Any:
        # A C++-wrapper graph is traced with its layers inlined; the torch.compile fallback guards on that
        # switch at every call.
        with inlined_layers() if self.inline else contextlib.nullcontext():
            if self._call is None:
                self._call = self.compiler._materialize(self.name, self.fn, args)
            return self._call(*args)
