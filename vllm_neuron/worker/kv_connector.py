"""The runner's side of disaggregated prefill/decode: every tensor-parallel rank serves the blocks its instance
holds for remote readers (a prefill instance) and reads its own KV heads of a remote request's blocks into the
local pool (a decode instance). Source and reader may differ in tensor-parallel size: head_split.py says which
source rank holds which of a reader's heads. The transport is the config's `kv_connector`: `TcpConnector` reads
the blocks as frames from the source's block server; `NixlConnector` asks that server for the source's NIXL agent
under the same checks and reads the blocks through NIXL (distributed/kv_transfer/nixl.py).

Reads run on a thread of their own, so a slow or unreachable source delays only its request: the engine starts
them (`start_loads`), goes on stepping, and polls (`poll_loads`). They write only into blocks allocated to
their request, which no step reads until the load has ended.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

from vllm_neuron.config.kv_transfer import KVTransferConfig
from vllm_neuron.distributed.kv_transfer.block_io import KVPairs, frame_bytes, scatter_blocks
from vllm_neuron.distributed.kv_transfer.head_split import read_plan
from vllm_neuron.distributed.kv_transfer.tcp import BlockClient, BlockServer, TransferError
from vllm_neuron.logger import init_logger
from vllm_neuron.step import KVLoadJob

logger = init_logger(__name__)

PENDING, FAILED, READ = -1, 0, 1  # poll_loads' answers (min over ranks: any pending, then any failed)


@dataclass
class LoadResult:
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    reason: str = ""


class KVConnectorWorker:
    def __init__(self, cfg: KVTransferConfig, kv: KVPairs, block_size: int, num_kv_heads: int, tp_rank: int,
                 tp_size: int) -> None:
        self.cfg, self.kv, self.block_size = cfg, kv, block_size
        self.num_kv_heads, self.tp_rank, self.tp_size = num_kv_heads, tp_rank, tp_size
        self.nixl = None
        if cfg.kv_connector == "NixlConnector":
            from vllm_neuron.distributed.kv_transfer.nixl import NixlAgent  # nixl is an optional install

            self.nixl = NixlAgent(kv, block_size, cfg.engine_id, tp_rank)
        ops = {"nixl_meta": self.nixl.meta_reply} if self.nixl is not None else None
        self.server = BlockServer(cfg.kv_ip, cfg.port_of(0, tp_size, tp_rank), kv, block_size, cfg.engine_id,
                                  ops) if cfg.is_producer else None
        self.client = BlockClient() if cfg.is_consumer else None
        self._results: dict[str, LoadResult] = {}
        self._done: list[LoadResult] = []  # for metrics, taken by take_results
        self._lock = threading.Lock()
        self._work: queue.Queue = queue.Queue()
        self._thread = None
        if self.client is not None:
            self._thread = threading.Thread(target=self._run, name="vllm-neuron-kv-reader", daemon=True)
            self._thread.start()
        if self.server is not None:
            logger.info("KV transfer (%s, %s): this rank serves held blocks on %s", cfg.kv_connector, cfg.kv_role,
                        self.server.address)

    # -- a prefill instance ---------------------------------------------------------------------------
    def hold(self, holds: list[tuple[str, str, list[list[int]]]]) -> None:
        for key, secret, groups in holds:
            self.server.hold(key, secret, groups)

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            self.server.forget(key)

    def drain_released(self) -> list[str]:
        return self.server.drain_released() if self.server is not None else []

    # -- a decode instance ----------------------------------------------------------------------------
    def start_loads(self, jobs: list[KVLoadJob]) -> None:
        for job in jobs:
            self._work.put(("load", job))

    def poll_loads(self, req_ids: list[str]) -> list[int]:
        """Per request: READ, FAILED (it prefills here instead) or PENDING. The answer stays until loads_done:
        with tensor parallelism every rank must answer the same poll (the engine takes the minimum)."""
        with self._lock:
            return [PENDING if (r := self._results.get(rid)) is None else READ if r.ok else FAILED for rid in req_ids]

    def take_results(self) -> list[LoadResult]:
        """The finished loads' sizes and times since the last call (for metrics; this rank's)."""
        with self._lock:
            out, self._done = self._done, []
        return out

    def loads_done(self, jobs: list[KVLoadJob]) -> None:
        """The engine took these loads' final answers: forget them, and tell each source its blocks were read
        (once, from the first rank: the source's first rank takes the release for all of its ranks); a source
        that does not answer frees them at its hold timeout."""
        with self._lock:
            for job in jobs:
                self._results.pop(job.req_id, None)
        if self.tp_rank == 0:
            for job in jobs:
                self._work.put(("release", job))

    def _run(self) -> None:
        while True:
            op, job = self._work.get()
            if op is None:
                return
            if op == "release":
                try:
                    self.client.release(f"{job.host}:{job.port}", job.key, job.secret, job.engine_id,
                                        self.cfg.fetch_timeout_s)
                except TransferError as e:
                    logger.info("request %s: could not tell %s:%s to free its blocks (%s); they go at its hold "
                                "timeout", job.req_id, job.host, job.port, e)
                continue
            t0 = time.perf_counter()
            try:
                result = LoadResult(True, self._load_one(job), time.perf_counter() - t0)
            except (TransferError, ValueError, OSError, RuntimeError) as e:
                reason = f"{type(e).__name__}: {e}"
                logger.warning("request %s: reading its KV blocks from %s:%s failed (%s); prefilling it here",
                               job.req_id, job.host, job.port, reason)
                result = LoadResult(False, 0, time.perf_counter() - t0, reason)
            with self._lock:
                self._results[job.req_id] = result
                self._done.append(result)

    def _load_one(self, job: KVLoadJob) -> int:
        nbytes = 0
        remote = [r for r, _ in job.groups]
        for part in read_plan(self.num_kv_heads, job.tp_size, self.tp_size, self.tp_rank):
            address = f"{job.host}:{job.port + part.src_rank}"
            if self.nixl is not None:
                nbytes += self.nixl.read(self.client, address, {"key": job.key, "secret": job.secret,
                                                                "engine_id": job.engine_id}, job.groups, part,
                                         self.cfg.fetch_timeout_s)
                continue
            frames = self.client.read(address, job.key, job.secret, job.engine_id,
                                      remote, (part.src_start, part.count), self.cfg.fetch_timeout_s)
            per_group = 2 * len(self.kv)
            if len(frames) != per_group * len(job.groups):
                raise TransferError(f"{len(frames)} frames for {len(job.groups)} groups of {per_group}")
            for g, (_, local) in enumerate(job.groups):
                scatter_blocks(self.kv, local, self.block_size, part.dst_start,
                               frames[g * per_group:(g + 1) * per_group])
            nbytes += frame_bytes(frames)
        return nbytes

    def close(self) -> None:
        if self._thread is not None:
            self._work.put((None, None))
            self._thread.join(2)
        if self.server is not None:
            self.server.close()
        if self.client is not None:
            self.client.close()
        if self.nixl is not None:
            self.nixl.close()
