"""The runner's side of the second KV tier: this rank's block files (config/kv_offload.py says where).

Stores: `store` copies the blocks out of the pool at once (the engine passes full, computed blocks, which no
step writes), then a writer thread writes one file per block: a magic line, a header naming the tier's model
key, the block's hash and each tensor's shape and dtype, the tensors' bytes, and a blake2b digest of all that.
It is written under a temporary name and renamed, so no reader sees half a file. Past this rank's share of the
size, the least recently used files go (a load counts as a use).

Loads: a reader thread reads a request's files, checks each (magic, model key, hash, shapes, digest) and writes
them into the request's blocks, which no step reads until the load has ended. A bad file (torn, foreign,
unreadable) ends the load there: the request prefills from that block on, and the file is deleted and counted.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from vllm_neuron.config.kv_offload import FILE_SUFFIX, KVOffloadConfig, block_file
from vllm_neuron.distributed.kv_transfer.block_io import KVPairs, gather_blocks, scatter_blocks
from vllm_neuron.logger import init_logger
from vllm_neuron.step import TierLoadJob

logger = init_logger(__name__)

MAGIC = b"vllm-neuron kv tier 1\n"
DIGEST_BYTES = 32
PENDING = -1  # kv_tier_poll's answer for a load not ended; else the blocks it read (min over ranks: all read)


class BadBlockFile(ValueError):
    """A block file that must not be served."""


@dataclass
class TierLoadResult:
    blocks: int  # read, from the first on
    nbytes: int
    seconds: float


def tier_folder(cfg: KVOffloadConfig, model_key: str, kv: KVPairs, block_size: int, world: int) -> str:
    """The sub-folder of one model, its weights and KV layout (every rank computes the same: shards are even)."""
    layout = [[list(t.shape[1:]), str(t.dtype)] for pair in kv for t in pair]
    digest = hashlib.sha256(json.dumps([model_key, layout, block_size, world]).encode()).hexdigest()
    return os.path.join(cfg.path, digest[:24])


def encode_block(key: str, block_hash: bytes, tensors: list[torch.Tensor]) -> bytes:
    header = json.dumps({"key": key, "hash": block_hash.hex(),
                         "tensors": [[list(t.shape), str(t.dtype)] for t in tensors]}).encode()
    body = b"".join([MAGIC, len(header).to_bytes(4, "little"), header] +
                    [t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for t in tensors])
    return body + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()


def decode_block(data: bytes, key: str, block_hash: bytes, expect: list[tuple[list[int], torch.dtype]]
                 ) -> list[torch.Tensor]:
    """The block's tensors, after every check (BadBlockFile saying which failed)."""
    if len(data) < len(MAGIC) + 4 + DIGEST_BYTES or not data.startswith(MAGIC):
        raise BadBlockFile("not a KV tier block file (magic)")
    body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
        raise BadBlockFile("digest mismatch (torn or altered)")
    n = int.from_bytes(body[len(MAGIC):len(MAGIC) + 4], "little")
    start = len(MAGIC) + 4 + n
    try:
        header = json.loads(body[len(MAGIC) + 4:start])
    except ValueError as e:
        raise BadBlockFile(f"unreadable header: {e}") from None
    if header.get("key") != key or header.get("hash") != block_hash.hex():
        raise BadBlockFile("written for another model or block")
    want = [[list(shape), str(dtype)] for shape, dtype in expect]
    if header.get("tensors") != want:
        raise BadBlockFile(f"tensors {header.get('tensors')} where {want} are expected")
    buf = bytearray(body[start:])
    out, offset = [], 0
    for shape, dtype in expect:
        count = dtype.itemsize
        for d in shape:
            count *= d
        if offset + count > len(buf):
            raise BadBlockFile("shorter than its header says")
        out.append(torch.frombuffer(buf, dtype=torch.uint8, count=count, offset=offset).view(dtype).view(shape))
        offset += count
    if offset != len(buf):
        raise BadBlockFile("longer than its header says")
    return out


class KVTierStore:
    def __init__(self, cfg: KVOffloadConfig, model_key: str, kv: KVPairs, block_size: int, rank: int,
                 world: int) -> None:
        self.kv, self.block_size, self.rank, self.key = kv, block_size, rank, model_key
        self.folder = tier_folder(cfg, model_key, kv, block_size, world)
        self.capacity = max(1, cfg.size_bytes // world)
        self._expect = [(list(t.shape[1:]), t.dtype) for pair in kv for t in pair]
        for e in self._expect:
            e[0].insert(0, block_size)
        self._heads = kv[0][0].shape[1]
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, int] = OrderedDict()  # path -> bytes, least recently used first
        self._bytes = 0
        self._scan()
        self._results: dict[str, TierLoadResult] = {}
        self.store_errors = 0
        self._writes: queue.Queue = queue.Queue()
        self._reads: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._write_loop, name="vllm-neuron-kv-tier-write", daemon=True),
                         threading.Thread(target=self._read_loop, name="vllm-neuron-kv-tier-read", daemon=True)]
        for t in self._threads:
            t.start()

    def _scan(self) -> None:
        """The files this rank left in the folder before (a restart), oldest first; trimmed to the capacity."""
        found = []
        suffix = f".r{self.rank}{FILE_SUFFIX}"
        if os.path.isdir(self.folder):
            for sub in os.scandir(self.folder):
                if not sub.is_dir():
                    continue
                for f in os.scandir(sub.path):
                    if f.name.endswith(suffix):
                        try:
                            st = f.stat()
                        except OSError:
                            continue
                        found.append((st.st_mtime, f.path, st.st_size))
        for _, path, size in sorted(found):
            self._lru[path] = size
            self._bytes += size
        self._evict()
        if found:
            logger.info("KV offloading: %d block file(s) of this model found in %s (%.1f MiB)", len(self._lru),
                        self.folder, self._bytes / 2**20)

    def _evict(self) -> None:
        with self._lock:
            while self._bytes > self.capacity and self._lru:
                path, size = self._lru.popitem(last=False)
                self._bytes -= size
                try:
                    os.unlink(path)
                except OSError:
                    pass

    # -- stores ---------------------------------------------------------------------------------------------
    def store(self, blocks: list[tuple[int, bytes]]) -> None:
        """Copies these (block id, hash) blocks out now; their files are written on the writer thread."""
        if not blocks:
            return
        frames = gather_blocks(self.kv, [b for b, _ in blocks], self.block_size, 0, self._heads)
        for i, (_, h) in enumerate(blocks):
            self._writes.put((h, [f[i] for f in frames]))

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            if item is None:
                return
            try:
                self._write_one(*item)
            finally:
                self._writes.task_done()

    def _write_one(self, h: bytes, tensors: list[torch.Tensor]) -> None:
        path = block_file(self.folder, h, self.rank)
        if path in self._lru:
            return
        tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            data = encode_block(self.key, h, tensors)
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as e:  # a full disk or a folder gone: the block stays in the pool only
            self.store_errors += 1
            if self.store_errors == 1 or self.store_errors % 1000 == 0:
                logger.warning("KV offloading: could not write %s (%s); %d block(s) not offloaded so far",
                               path, e, self.store_errors)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return
        with self._lock:
            self._lru[path] = len(data)
            self._bytes += len(data)
        self._evict()

    # -- loads ----------------------------------------------------------------------------------------------
    def load(self, jobs: list[TierLoadJob]) -> None:
        for job in jobs:
            self._reads.put(job)

    def _read_loop(self) -> None:
        while True:
            job = self._reads.get()
            if job is None:
                return
            t0 = time.perf_counter()
            n, nbytes = self._load_one(job)
            result = TierLoadResult(n, nbytes, time.perf_counter() - t0)
            with self._lock:
                self._results[job.req_id] = result

    def _load_one(self, job: TierLoadJob) -> tuple[int, int]:
        """(blocks read from the first on, their bytes): up to the first file that is missing or bad."""
        per_block, nbytes = [], 0
        for h in job.hashes:
            path = block_file(self.folder, h, self.rank)
            try:
                with open(path, "rb") as f:
                    data = f.read()
                per_block.append(decode_block(data, self.key, h, self._expect))
            except (OSError, BadBlockFile) as e:
                if isinstance(e, BadBlockFile):
                    self._forget(path)
                logger.warning("KV offloading: request %s prefills %d of its %d block(s) to read instead (%s: %s: "
                               "%s)", job.req_id, len(job.hashes) - len(per_block), len(job.hashes),
                               type(e).__name__, path, e)
                break
            nbytes += len(data)
            self._touch(path, len(data))
        if per_block:
            frames = [torch.stack([b[j] for b in per_block]) for j in range(len(self._expect))]
            scatter_blocks(self.kv, job.blocks[:len(per_block)], self.block_size, 0, frames)
        return len(per_block), nbytes

    def _touch(self, path: str, size: int) -> None:
        with self._lock:
            if path not in self._lru:  # another replica's file: now counted here too
                self._bytes += size
                self._lru[path] = size
            self._lru.move_to_end(path)
        try:
            os.utime(path)
        except OSError:
            pass

    def _forget(self, path: str) -> None:
        with self._lock:
            self._bytes -= self._lru.pop(path, 0)
        try:
            os.unlink(path)
        except OSError:
            pass

    def poll(self, req_ids: list[str]) -> list[int]:
        with self._lock:
            return [PENDING if (r := self._results.get(rid)) is None else r.blocks for rid in req_ids]

    def finish(self, req_ids: list[str]) -> list[tuple[int, int, float]]:
        """Forgets these loads' answers; their (blocks read, bytes, seconds)."""
        with self._lock:
            done = [self._results.pop(rid, None) for rid in req_ids]
        return [(r.blocks, r.nbytes, r.seconds) for r in done if r is not None]

    def flush(self, timeout_s: float = 30.0) -> None:
        """Waits for the writes queued so far (a clean shutdown keeps them)."""
        deadline = time.monotonic() + timeout_s
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self.flush()
        self._writes.put(None)
        self._reads.put(None)
        for t in self._threads:
            t.join(5)
