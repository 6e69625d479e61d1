"""One compiled graph per bucket, and the persistent compile cache.

Graphs are compiled with torch.compile on static shapes (the "native route"); `eager` runs the same
functions uncompiled. The cache has two layers:
* inductor's own content-addressed cache (FX graphs, kernels), shared by every model under
  `<cache root>/inductor` so the costly first-compile setup happens once per machine;
* a manifest per cache key `<cache root>/<key>/manifest.json` recording which buckets were compiled.
  The key covers what the seeds list under "What triggers recompilation": library versions, the
  model's config and our model code, bucket-independent graph options, dtype, device type and TP
  degree. `VLLM_NEURON_DISABLE_WARMUP_COMPILE=1` makes a bucket missing from the manifest fatal.
Every shape is static, the KV cache's included: a dynamic slot dimension makes inductor copy the
whole cache on every in-place write (24 ms per layer and step measured). So the manifest also records
the KV size it was compiled for, and a restart reuses that size when it fits the memory budget
(memory-based sizing varies a little between starts).
"""
from __future__ import annotations

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

from vllm_neuron import envs
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

_PKG_ROOT = Path(__file__).resolve().parent.parent
# Code that shapes the traced graphs: a change here must invalidate the manifest.
_GRAPH_CODE_DIRS = ("model", "worker")


def _code_fingerprint() -> str:
    h = hashlib.sha256()
    for sub in _GRAPH_CODE_DIRS:
        for path in sorted(p for ext in ("*.py", "*.cpp") for p in (_PKG_ROOT / sub).rglob(ext)):
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
        if not self.disabled and self.manifest_path.exists():
            saved = json.loads(self.manifest_path.read_text())
            self.manifest = saved.get("buckets", {})
            self.manifest_num_blocks = saved.get("num_blocks")
        self.num_blocks: int | None = None
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

    def set_num_blocks(self, num_blocks: int) -> None:
        """The KV size the graphs are compiled for; a different size than the manifest's invalidates it."""
        if self.manifest_num_blocks is not None and self.manifest_num_blocks != num_blocks:
            logger.info("KV cache size changed (%d -> %d blocks): every bucket recompiles",
                        self.manifest_num_blocks, num_blocks)
            self.manifest = {}
        self.num_blocks = num_blocks

    def compile(self, fn: Callable) -> Callable:
        if self.backend == "eager":
            return fn
        return torch.compile(fn, dynamic=False, fullgraph=True)

    def warm(self, name: str, run: Callable[[], Any]) -> BucketCompileRecord:
        """Runs one bucket's graph once on dummy inputs, compiling it (or loading it from the cache)."""
        in_manifest = name in self.manifest
        if self.backend == "native" and self.fail_on_miss and not in_manifest:
            raise RuntimeError(
                f"VLLM_NEURON_DISABLE_WARMUP_COMPILE=1 and bucket {name} is not in the compile cache "
                f"{self.dir} (key {self.key}); run `vllm-neuron compile` with the same configuration first")
        from torch._dynamo.utils import counters

        misses0 = counters["inductor"]["fxgraph_cache_miss"]
        t0 = time.perf_counter()
        run()
        seconds = time.perf_counter() - t0
        misses = counters["inductor"]["fxgraph_cache_miss"] - misses0
        hit = self.backend == "native" and in_manifest and misses == 0
        rec = BucketCompileRecord(name, seconds, hit)
        self.records.append(rec)
        if self.backend == "native":
            logger.info("Bucket %s: %s in %.1f s", name, "compile cache hit, loaded" if hit else
                        "compile cache miss, compiled", seconds)
            self.manifest[name] = {"compile_seconds": round(seconds, 3), "time": time.time()}
            self._save()
        return rec

    def _save(self) -> None:
        if self.disabled:
            return
        tmp = self.manifest_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": self.key, "num_blocks": self.num_blocks, "buckets": self.manifest},
                                  indent=1, sort_keys=True))
        os.replace(tmp, self.manifest_path)

    @property
    def num_compiled(self) -> int:
        """Buckets compiled from scratch in this process (not served by the cache)."""
        return sum(1 for r in self.records if not r.cache_hit) if self.backend == "native" else 0
