"""One compiled graph per bucket, and the persistent compile cache.

Graphs are compiled with torch.compile on static shapes (the "native route"); `eager` runs the same
functions uncompiled. The cache has two layers:
* inductor's own content-addressed cache (FX graphs, kernels), shared by every model under
  `<cache root>/inductor` so the costly first-compile setup happens once per machine;
* a manifest per cache key `<cache root>/<key>/manifest.json` recording which buckets were compiled.
  The key covers what the seeds list under "What triggers recompilation": library versions, the
  model's config and our model code, bucket-independent graph options, dtype, device type and TP
  degree. `VLLM_NEURON_DISABLE_WARMUP_COMPILE=1` makes a bucket missing from the manifest fatal.
Each bucket's graph is compiled ahead of time (`torch.compile(...).aot_compile`) and saved as
`<key>/aot/<bucket>.bin`: dynamo's bytecode, guards and the compiled inductor graph, without weights. A
warm start loads that file instead of re-tracing the model with dynamo, which is what made warm starts
slow (about 1.5 s per graph traced, against 0.1-0.3 s loaded). Where ahead-of-time compilation is
unavailable (disabled cache, `VLLM_NEURON_AOT_COMPILE=0`, or a failure) the bucket is compiled with plain
torch.compile and inductor's cache alone speeds up its next start.
Every shape is static, the KV cache's included: a dynamic slot dimension makes inductor copy the
whole cache on every in-place write (24 ms per layer and step measured). So the manifest also records
the KV size it was compiled for and the sizing configuration that chose it; worker/memory.py's
`plan_kv_pool` reuses that size on a restart whatever the free memory (or refuses with the arithmetic
when it no longer fits).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree

from vllm_neuron import envs
from vllm_neuron.logger import init_logger

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
    }


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
            inductor_dir = Path(self.root) / "inductor"
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
        self._source: str | None = None  # how the last bucket materialized: loaded / compiled / traced
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
        with open(self.dir / "key.json", "w") as f:
            json.dump(self.key_parts, f, indent=1, sort_keys=True, default=str)

    def set_num_blocks(self, num_blocks: int, kv_sizing: dict[str, Any] | None = None) -> None:
        """The KV size the graphs are compiled for, and what chose it (recorded with it); a different
        size than the manifest's invalidates it."""
        if self.manifest_num_blocks is not None and self.manifest_num_blocks != num_blocks:
            logger.info("KV cache size changed (%d -> %d blocks): every bucket recompiles",
                        self.manifest_num_blocks, num_blocks)
            self.manifest = {}
        self.num_blocks = num_blocks
        self.kv_sizing = kv_sizing

    def bucket(self, name: str, fn: Callable) -> "BucketGraph":
        """The graph of bucket `name` running the bound method `fn` (of an object holding the model)."""
        return BucketGraph(self, name, fn)

    def _aot_path(self, name: str) -> Path:
        return self.dir / "aot" / f"{name}.bin"

    def _materialize(self, name: str, fn: Callable, args: tuple) -> Callable:
        """A callable for bucket `name`: loaded from the cache, else compiled with `args` as the example."""
        if self.backend == "eager":
            return fn
        owner = fn.__self__
        external = {"graphs": owner, "model": owner.model}
        use_aot = not self.disabled and bool(envs.VLLM_NEURON_AOT_COMPILE)
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
                    compiled = torch.compiler.load_compiled_function(f, external_data=external)
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
                    # The guards are saved with the graph: only tensor guards survive serialization.
                    "guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}).aot_compile((args, {}))
                path.parent.mkdir(parents=True, exist_ok=True)
                compiled.save_compiled_function(str(path), external_data=external)
                _write_text_atomic(sig_path, signature)
                compiled.disable_guard_check()
                self._source = "compiled"
                return functools.partial(compiled, owner)
            except Exception as e:
                logger.warning("Bucket %s: ahead-of-time compilation failed (%s: %s); using torch.compile, "
                               "which re-traces this graph on every start", name, type(e).__name__, e)
        self._source = "traced"
        return torch.compile(fn, dynamic=False, fullgraph=True)

    def warm(self, name: str, run: Callable[[], Any]) -> BucketCompileRecord:
        """Runs one bucket's graph once on dummy inputs, compiling it (or loading it from the cache)."""
        in_manifest = name in self.manifest
        from torch._dynamo.utils import counters

        misses0 = counters["inductor"]["fxgraph_cache_miss"]
        self._source = None
        t0 = time.perf_counter()
        run()
        seconds = time.perf_counter() - t0
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
        if self.disabled:
            return
        _write_text_atomic(self.manifest_path, json.dumps(
            {"key": self.key, "num_blocks": self.num_blocks, "kv_sizing": self.kv_sizing, "buckets": self.manifest},
            indent=1, sort_keys=True))

    @property
    def num_compiled(self) -> int:
        """Buckets compiled from scratch in this process (not served by the cache)."""
        return sum(1 for r in self.records if not r.cache_hit) if self.backend == "native" else 0


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # a concurrent start never reads half a file


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

    def __call__(self, *args: Any) -> Any:
        if self._call is None:
            self._call = self.compiler._materialize(self.name, self.fn, args)
        return self._call(*args)
