"""KV offloading in the engine loop: the fixed points where EngineCore hands the scheduler's side of the second
tier (core/kv_tier.py) to the runner's (worker/kv_tier_store.py) and back.

* `before_schedule`: reads that ended let their requests prefill from after the blocks read (every rank read:
  the tensor-parallel executor answers a poll with the minimum over its ranks).
* `after_schedule`: reads of the requests just admitted start (on the runner's reader thread).
* `after_update`: blocks the prefix cache just registered are copied out of the pool (before any later step can
  reuse them) and written to the tier by the runner's writer thread.

Runner calls go through `call`, the engine's way of ordering them after steps still executing.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable
from typing import Any

from vllm_neuron.config.kv_offload import KVOffloadConfig
from vllm_neuron.version import __version__
from vllm_neuron.logger import init_logger
from vllm_neuron.worker.kv_tier_store import PENDING

logger = init_logger(__name__)


def model_key(config, ckpt) -> str:
    """What the tier's blocks depend on besides the layout the runner adds: the weights (files by name, size and
    modification time), the model's config, the dtype, quantization and KV cache dtype, and this version (our
    kernels compute the values). Any change gives a new folder: a block is never served to another model."""
    files = ckpt.gguf_files if ckpt.is_gguf else sorted(glob.glob(os.path.join(ckpt.path, "*.safetensors")))
    stats = [(os.path.basename(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    nc = config.additional_config.neuron_config
    parts = {"files": stats, "config": ckpt.hf_config.to_json_string(), "dtype": config.dtype,
             "quantization": repr(nc.quantization), "kv_cache_dtype": config.kv_cache_dtype, "version": __version__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class KVTierEngine:
    def __init__(self, cfg: KVOffloadConfig, folder: str, call: Callable[..., Any]) -> None:
        self.cfg, self.folder, self.call = cfg, folder, call
        self.bytes_read = 0
        self.load_seconds: list[float] = []  # since the stats took them
        logger.info("KV offloading: %s; this model's blocks in %s", cfg.describe(), folder)

    def before_schedule(self, scheduler) -> None:
        side = scheduler.kv_tier
        if not side.loading:
            return
        ids = list(side.loading)
        done = [(rid, s) for rid, s in zip(ids, self.call("kv_tier_poll", ids)) if s != PENDING]
        if not done:
            return
        for rid, n in done:
            scheduler.finish_tier_load(rid, n)
        for n, nbytes, seconds in self.call("kv_tier_finish", [rid for rid, _ in done]):
            self.bytes_read += nbytes
            if n:
                self.load_seconds.append(seconds)

    def after_schedule(self, scheduler) -> None:
        self._hand_over(scheduler)

    def after_update(self, scheduler) -> None:
        self._hand_over(scheduler)

    def _hand_over(self, scheduler) -> None:
        loads, stores = scheduler.take_tier_work()
        if stores:
            self.call("kv_tier_store", stores)
        if loads:
            self.call("kv_tier_load", loads)

    @staticmethod
    def busy(scheduler) -> bool:
        """Reads in flight: the engine has work even when no step can be scheduled."""
        return bool(scheduler.kv_tier.loading)

    def stats(self, scheduler) -> tuple:
        """(loads, blocks read, failed loads, blocks written, bytes read, new load times); the times are handed
        over once."""
        s = scheduler.kv_tier.stats
        new, self.load_seconds = self.load_seconds, []
        return s.loads, s.loaded_blocks, s.failed_loads, s.stored_blocks, self.bytes_read, new
