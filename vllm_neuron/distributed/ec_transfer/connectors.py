"""The EC connectors: how an encoder instance's embeddings reach a prefill+decode instance (record.py says how a
record proves what it holds).

* `ECSharedStorageConnector`: one file per item, `<folder>/<key>.ec`, written to a temporary name and renamed
  (a reader never sees half a file); a write that fails (a full disk) removes its temporary file and raises
  `ECTransferError`, which fails that encode request only. After each write the producer removes the folder's
  oldest records (by modification time) beyond `hold_bytes`: a consumer reads an item within moments of its
  encode job, and without a cap the folder grew until the disk was full.
* `ECTcpConnector`: the producer keeps its records in memory (up to `hold_bytes`, oldest out first) and answers
  `has` / `get` on the KV connector's pyzmq transport (tcp.py's FrameServer / BlockClient, JSON headers, the
  record as one frame); the consumer asks each of its `producers` in turn.

A consumer asks only for items its encoder cache lacks (the runner looks there first).
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
from collections import OrderedDict

import torch

from vllm_neuron.config.ec_transfer import ECTransferConfig, check_shared_folder
from vllm_neuron.distributed.ec_transfer.record import ECTransferError, decode_record, ec_key, encode_record
from vllm_neuron.distributed.kv_transfer.tcp import BlockClient, FrameServer, TransferError
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)


class ECConnector:
    """What the encoder instance (save) and the prefill+decode instance (has / load) call."""

    def __init__(self, config: ECTransferConfig, model_id: str) -> None:
        self.config, self.model_id = config, model_id
        self.bytes_written = 0
        self.bytes_read = 0

    def save(self, mm_hash: str, embeds: torch.Tensor, deepstack: torch.Tensor) -> int:
        """Bytes written; ECTransferError when they cannot be."""
        raise NotImplementedError

    def has(self, mm_hash: str) -> bool:
        raise NotImplementedError

    def load(self, mm_hash: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class ECSharedStorageConnector(ECConnector):
    def __init__(self, config: ECTransferConfig, model_id: str) -> None:
        check_shared_folder(config)
        super().__init__(config, model_id)
        self.folder = config.shared_storage_path

    def path(self, mm_hash: str) -> str:
        return os.path.join(self.folder, ec_key(mm_hash, self.model_id) + ".ec")

    def save(self, mm_hash: str, embeds: torch.Tensor, deepstack: torch.Tensor) -> int:
        data = encode_record(mm_hash, self.model_id, embeds, deepstack)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".partial-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(mm_hash))
        except OSError as e:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            raise ECTransferError(f"cannot write the embeddings of media {mm_hash[:16]} to {self.folder} "
                                  f"({e.strerror or e})") from None
        self.bytes_written += len(data)
        self.prune(keep=self.path(mm_hash))
        return len(data)

    def prune(self, keep: str = "") -> int:
        """Removes the oldest records until the folder's records total at most hold_bytes (never `keep`,
        the record just written); returns how many went. Another producer pruning the same folder at the
        same time may have removed a file first: that is no error."""
        records = []
        with os.scandir(self.folder) as entries:
            for e in entries:
                if e.name.endswith(".ec") and e.path != keep:
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    records.append((st.st_mtime_ns, st.st_size, e.path))
        total = sum(size for _, size, _ in records) + (os.path.getsize(keep) if keep else 0)
        removed = 0
        for _, size, path in sorted(records):
            if total <= self.config.hold_bytes:
                break
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
            total -= size
        return removed

    def has(self, mm_hash: str) -> bool:
        return os.path.exists(self.path(mm_hash))

    def load(self, mm_hash: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        path = self.path(mm_hash)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ECTransferError(f"cannot read {path} ({e.strerror or e})") from None
        self.bytes_read += len(data)
        return decode_record(data, mm_hash, self.model_id, path)


class _RecordServer(FrameServer):
    """The producer's records, by key, answered to `has` / `get`."""

    def __init__(self, host: str, port: int, hold_bytes: int) -> None:
        self._records: OrderedDict[str, bytes] = OrderedDict()
        self._nbytes, self._hold = 0, hold_bytes
        self._lock = threading.Lock()
        super().__init__(host, port, ("ec_transfer_config", "embeddings"), "vllm-neuron-ec-server")

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            if key in self._records:
                return
            self._records[key] = data
            self._nbytes += len(data)
            while self._nbytes > self._hold and len(self._records) > 1:
                _, old = self._records.popitem(last=False)
                self._nbytes -= len(old)

    def holds(self, key: str) -> bool:
        with self._lock:
            return key in self._records

    def _answer(self, req: dict) -> list:
        op, key = req.get("op"), req.get("key")
        if op not in ("has", "get") or not isinstance(key, str):
            raise TransferError(f"unknown request {op!r}; valid ops: has, get (with a key)")
        with self._lock:
            data = self._records.get(key)
        header = json.dumps({"ok": True, "found": data is not None}).encode()
        return [header, data] if op == "get" and data is not None else [header]


class ECTcpConnector(ECConnector):
    def __init__(self, config: ECTransferConfig, model_id: str) -> None:
        super().__init__(config, model_id)
        self.server = _RecordServer(config.ec_ip, config.ec_port, config.hold_bytes) if config.is_producer else None
        self.client = BlockClient() if config.is_consumer else None

    def save(self, mm_hash: str, embeds: torch.Tensor, deepstack: torch.Tensor) -> int:
        data = encode_record(mm_hash, self.model_id, embeds, deepstack)
        self.server.put(ec_key(mm_hash, self.model_id), data)
        self.bytes_written += len(data)
        return len(data)

    def _ask(self, op: str, mm_hash: str) -> tuple[str, list] | None:
        key = ec_key(mm_hash, self.model_id)
        for address in self.config.producers:
            try:
                reply, *frames = self.client.call(address, {"op": op, "key": key}, self.config.fetch_timeout_s)
            except TransferError as e:
                logger.warning("EC producer %s did not answer (%s); asking the next", address, e)
                continue
            if reply.get("found"):
                return address, frames
        return None

    def has(self, mm_hash: str) -> bool:
        """A producer: whether it still serves the item; a consumer: whether a producer does."""
        if self.server is not None and self.server.holds(ec_key(mm_hash, self.model_id)):
            return True
        return self.client is not None and self._ask("has", mm_hash) is not None

    def load(self, mm_hash: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        found = self._ask("get", mm_hash)
        if found is None or not found[1]:
            return None
        address, (frame, *_) = found
        self.bytes_read += len(frame.buffer)
        return decode_record(frame.buffer, mm_hash, self.model_id, f"from {address}")

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.client is not None:
            self.client.close()


def make_ec_connector(config: ECTransferConfig | None, model_id: str) -> ECConnector | None:
    if config is None:
        return None
    cls = {"ECSharedStorageConnector": ECSharedStorageConnector, "ECTcpConnector": ECTcpConnector}[config.ec_connector]
    connector = cls(config, model_id)
    logger.info("EC connector: %s (model id %s)", config.describe(), model_id[:16])
    return connector
