"""`TcpConnector`'s transport: a prefill instance serves held blocks over pyzmq, each tensor one zero-copy frame.

Every tensor-parallel rank of a prefill instance runs a `BlockServer` (a ROUTER socket on its own port, served
by a daemon thread) that answers these requests, each a JSON header frame:

* `read`: {key, secret, groups: [[block id, ...] per KV cache group], heads: [start, count]} -> a JSON header
  {ok, shapes, dtype} and one frame per K / V tensor and group (block_io's layout); the blocks must be among
  those held for `key` under `secret`, so a reader never gets another request's KV;
* `release`: {key, secret} -> the reader is done; the instance's scheduler frees the blocks at its next tick;
* ops a transport adds (`ops`, nixl.py's `nixl_meta`), asked like `read` and checked the same way first.

Headers are JSON, never pickle: the socket may face the network. A reader (`fetch`) waits at most its timeout
for the reply and raises `TransferError` with the reason otherwise.
"""
from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from vllm_neuron.distributed.kv_transfer.block_io import KVPairs, gather_blocks
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

_DTYPES = {str(dt).removeprefix("torch."): dt for dt in (torch.float32, torch.bfloat16, torch.float16,
                                                         torch.float8_e4m3fn, torch.float8_e5m2)}


class TransferError(RuntimeError):
    pass


@dataclass
class _Hold:
    secret: str
    groups: list[set[int]]


class FrameServer:
    """A ROUTER socket on host:port answered by a daemon thread: each request one JSON header frame, each reply
    a list of frames from `_answer` (a raised error becomes {ok: false, error}). `what` names the option and
    the data in the bind error."""

    def __init__(self, host: str, port: int, what: tuple[str, str], thread_name: str) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        option, data = what
        try:
            self._sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"{option}: cannot serve {data} on {host}:{port} ({e}); pick another port or "
                             "address") from e
        self.address = f"{host}:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(linger=0)
        self._ctx.term()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, *parts = self._sock.recv_multipart()
            try:
                reply = self._answer(json.loads(parts[0]) if parts else {})
            except Exception as e:  # noqa: BLE001 - a bad request is the reader's failure, never this thread's
                reply = [json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}).encode()]
            self._sock.send_multipart([ident, *reply], copy=False)

    def _answer(self, req: dict) -> list:
        raise NotImplementedError


class BlockServer(FrameServer):
    """Serves this rank's blocks of the requests it holds (hold / release come from the scheduler's side)."""

    def __init__(self, host: str, port: int, kv: KVPairs, block_size: int, engine_id: str,
                 ops: dict[str, Callable[[dict, list[list[int]], int, int], list]] | None = None) -> None:
        self.kv, self.block_size, self.engine_id = kv, block_size, engine_id
        # op -> answer(request, groups, head start, head count): called once the request passed read's checks.
        self._ops = {"read": self._read, **(ops or {})}
        self._holds: dict[str, _Hold] = {}
        self._released: list[str] = []
        self._lock = threading.Lock()
        super().__init__(host, port, ("kv_transfer_config", "KV blocks"), "vllm-neuron-kv-server")

    # -- the scheduler's side ---------------------------------------------------------------------------
    def hold(self, key: str, secret: str, groups: list[list[int]]) -> None:
        with self._lock:
            self._holds[key] = _Hold(secret, [set(g) for g in groups])

    def forget(self, key: str) -> None:
        with self._lock:
            self._holds.pop(key, None)

    def drain_released(self) -> list[str]:
        with self._lock:
            out, self._released = self._released, []
        return out

    # -- the serving thread ---------------------------------------------------------------------------------
    def _answer(self, req: dict) -> list:
        op, key, secret = req.get("op"), req.get("key"), req.get("secret")
        if req.get("engine_id") and req["engine_id"] != self.engine_id:
            raise TransferError(f"this is engine {self.engine_id!r}, not {req['engine_id']!r}")
        with self._lock:
            hold = self._holds.get(key) if isinstance(key, str) else None
            if hold is None or secret != hold.secret:
                raise TransferError(f"no blocks are held for request {key!r} here (finished and freed, never held, "
                                    "or a wrong secret)")
            if op == "release":
                self._holds.pop(key)
                self._released.append(key)
                return [json.dumps({"ok": True}).encode()]
            if op not in self._ops:
                raise TransferError(f"unknown op {op!r}; valid ops: {', '.join([*self._ops, 'release'])}")
            groups = req.get("groups")
            if not isinstance(groups, list) or len(groups) != len(hold.groups) or any(
                    not isinstance(g, list) or not set(g) <= held for g, held in zip(groups, hold.groups)):
                raise TransferError(f"blocks {groups!r} are not the ones held for request {key!r}")
        heads = req.get("heads", [0, self.kv[0][0].shape[1]])
        n_heads = self.kv[0][0].shape[1]
        if not (isinstance(heads, list) and len(heads) == 2 and all(type(h) is int for h in heads)
                and 0 <= heads[0] and 0 < heads[1] and heads[0] + heads[1] <= n_heads):
            raise TransferError(f"heads {heads!r} are not a [start, count] range of this rank's {n_heads}")
        return self._ops[op](req, groups, *heads)

    def _read(self, req: dict, groups: list[list[int]], start: int, count: int) -> list:
        frames = [f for g in groups for f in gather_blocks(self.kv, g, self.block_size, start, count)]
        header = {"ok": True, "shapes": [list(f.shape) for f in frames],
                  "dtype": str(self.kv[0][0].dtype).removeprefix("torch.")}
        return [json.dumps(header).encode(), *(memoryview(f.view(torch.uint8).numpy()) for f in frames)]


class BlockClient:
    """A reader's sockets, one per server address, kept for later transfers."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket] = {}
        self._lock = threading.Lock()

    def call(self, address: str, header: dict, timeout_s: float) -> list:
        """One request to the block server at `address`: [its JSON reply (ok), its frames (zmq.Frame)...]."""
        with self._lock:
            sock = self._socks.get(address)
            if sock is None:
                # zmq connects in the background and would wait out the whole timeout for a closed port or an
                # unknown host: a plain connect first says so at once.
                host, _, port = address.rpartition(":")
                try:
                    socket.create_connection((host, int(port)), timeout=min(timeout_s, 3.0)).close()
                except OSError as e:
                    raise TransferError(f"cannot reach {address}: {e}") from None
                sock = self._socks[address] = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"tcp://{address}")
            sock.send(json.dumps(header).encode())
            if not sock.poll(int(timeout_s * 1000)):
                # A reply that comes after the deadline must not answer the next request on this socket.
                sock.close(linger=0)
                del self._socks[address]
                raise TransferError(f"no answer from {address} within {timeout_s:g} s")
            parts = sock.recv_multipart(copy=False)
        reply = json.loads(parts[0].bytes)
        if not reply.get("ok"):
            raise TransferError(f"{address} refused: {reply.get('error')}")
        return [reply, *parts[1:]]

    def read(self, address: str, key: str, secret: str, engine_id: str, groups: list[list[int]],
             heads: tuple[int, int], timeout_s: float) -> list[torch.Tensor]:
        reply, *frames = self.call(address, {"op": "read", "key": key, "secret": secret, "engine_id": engine_id,
                                              "groups": groups, "heads": list(heads)}, timeout_s)
        dtype = _DTYPES.get(reply.get("dtype"))
        if dtype is None or len(frames) != len(reply["shapes"]):
            raise TransferError(f"{address} sent {len(frames)} frames of {reply.get('dtype')}, announced "
                                f"{len(reply['shapes'])}")
        return [torch.frombuffer(bytearray(f.buffer), dtype=torch.uint8).view(dtype).view(*shape)
                for f, shape in zip(frames, reply["shapes"])]

    def release(self, address: str, key: str, secret: str, engine_id: str, timeout_s: float) -> None:
        self.call(address, {"op": "release", "key": key, "secret": secret, "engine_id": engine_id}, timeout_s)

    def close(self) -> None:
        for s in self._socks.values():
            s.close(linger=0)
        self._ctx.term()
