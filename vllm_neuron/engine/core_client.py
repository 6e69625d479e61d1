"""The API server's link to its EngineCore replicas: one ZMQ ROUTER socket, the replicas' liveness.

Every replica is an EngineCore process with a DEALER socket named `engine-<rank>` (engine/replica.py).
The replicas of this host are spawned here and connect over ipc; with multi-node data parallelism the
socket also listens on tcp://data_parallel_address:data_parallel_rpc_port, where the replicas of a
`serve --headless` node connect, next to that node's supervisor (`node-<first rank>`), whose
heartbeats say which of its replicas live. A replica is dead when its process exits (this host), when
its node reports it, when its node's heartbeats stop for NODE_TIMEOUT_S, or when it sends nothing for
VLLM_ENGINE_ITERATION_TIMEOUT_S while it has requests in flight (hung; a busy engine reports every
second, core_proc.ALIVE_S).

Messages are pickled tuples (engine/core_proc.py lists them); the RPC port must face a trusted network.
"""
from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from vllm_neuron import metrics
from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.engine.core_proc import spawn_replica
from vllm_neuron.engine.replica import engine_identity, host_placements, rank_of_identity
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

HEARTBEAT_S = 1.0  # a headless node's heartbeat period
NODE_TIMEOUT_S = 10.0  # silence after which a node's replicas count as dead


@dataclass
class Replica:
    rank: int
    proc: Any = None  # multiprocessing.Process on this host; None for a remote replica
    node: bytes | None = None  # the supervisor identity of a remote replica's node
    last_heard: float = 0.0  # monotonic time of its last message (or of getting work while idle)
    connected: bool = False
    ready: bool = False
    dead: str | None = None
    info: dict = field(default_factory=dict)


def _ipc_dir() -> str:
    """A private folder for the engines' IPC socket. A socket's path holds at most 107 bytes (sun_path), so
    under a long TMPDIR it goes to /tmp instead."""
    folder = tempfile.mkdtemp(prefix="vllm_neuron_ipc_")
    if len(os.path.join(folder, "engines").encode()) > 100:
        os.rmdir(folder)
        folder = tempfile.mkdtemp(prefix="vllm_neuron_ipc_", dir="/tmp")
    return folder


class CoreClient:
    """Spawns this host's replicas and carries messages to and from all of them (one event loop)."""

    def __init__(self, config: EngineConfig, model_name: str) -> None:
        from vllm_neuron import envs

        self.replicas = [Replica(r) for r in range(config.data_parallel_size)]
        self.iteration_timeout: float = envs.VLLM_ENGINE_ITERATION_TIMEOUT_S
        self._nodes: dict[bytes, float] = {}  # supervisor identity -> last heartbeat (monotonic)
        self._ipc_dir = _ipc_dir()
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a message to a vanished peer raises, never vanishes
        self.sock.setsockopt(zmq.LINGER, 0)
        local_addr = f"ipc://{os.path.join(self._ipc_dir, 'engines')}"
        self.sock.bind(local_addr)
        self.remote_address = None
        if config.multi_node_dp:
            self.remote_address = f"tcp://{config.data_parallel_address}:{config.data_parallel_rpc_port}"
            self.sock.bind(self.remote_address)
            logger.info("Data parallel: replicas %d..%d join at %s (serve --headless on their nodes)",
                        config.local_dp_replicas, config.data_parallel_size - 1, self.remote_address)
        # Sends happen from synchronous code (aborts in finally blocks): a blocking shadow of the socket.
        self._send_sock = zmq.Socket.shadow(self.sock.underlying)
        try:
            for placement in host_placements(config, range(config.local_dp_replicas)):
                proc = spawn_replica(config, local_addr, placement, model_name)
                self.replicas[placement.rank].proc = proc
                logger.info("EngineCore process started (pid %d)%s", proc.pid,
                            f", data parallel rank {placement.rank}" if config.data_parallel_size > 1 else "")
        except BaseException:
            self.shutdown()
            raise

    # -- state -----------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.replicas)

    def alive(self) -> list[bool]:
        return [r.dead is None for r in self.replicas]

    @property
    def all_dead(self) -> bool:
        return all(r.dead is not None for r in self.replicas)

    def dead_reasons(self) -> dict[int, str]:
        return {r.rank: r.dead for r in self.replicas if r.dead is not None}

    def check_liveness(self, loads: list[int], now: float | None = None) -> list[tuple[int, str]]:
        """Replicas found dead since the last call: exited processes, silent nodes, and replicas silent
        for iteration_timeout with requests in flight (loads[rank] > 0), whose local process is killed."""
        now = time.monotonic() if now is None else now
        found = []
        for r in self.replicas:
            if r.dead is not None:
                continue
            if r.proc is not None and not r.proc.is_alive():
                found.append((r.rank, f"process exited with code {r.proc.exitcode}"))
            elif r.node is not None and now - self._nodes.get(r.node, now) > NODE_TIMEOUT_S:
                found.append((r.rank, f"its node sent no heartbeat for {NODE_TIMEOUT_S:.0f} s"))
            elif r.ready and loads[r.rank] > 0 and now - r.last_heard > self.iteration_timeout:
                found.append((r.rank, f"it made no progress for {now - r.last_heard:.0f} s with {loads[r.rank]} "
                                      f"request(s) in flight (VLLM_ENGINE_ITERATION_TIMEOUT_S="
                                      f"{self.iteration_timeout:g}); its process was killed"))
                if r.proc is not None:
                    r.proc.kill()
        return found

    def got_work(self, rank: int) -> None:
        """An idle replica was given a request: its silence counts from now."""
        self.replicas[rank].last_heard = time.monotonic()

    def mark_dead(self, rank: int, reason: str) -> bool:
        """Records a replica's death; False if it was already recorded."""
        r = self.replicas[rank]
        if r.dead is not None:
            return False
        r.dead = reason
        if r.proc is not None and r.proc.pid is not None:
            metrics.mark_process_dead(r.proc.pid)
        if r.node is not None and all(x.dead is not None for x in self.replicas if x.node == r.node):
            metrics.set_remote_samples(r.node.decode(), None)  # a node without replicas reports nothing live
        return True

    # -- messages --------------------------------------------------------------------------------
    def send(self, rank: int, msg: Any) -> bool:
        """Sends to replica `rank`; False (nothing sent) when it is dead or unreachable."""
        if self.replicas[rank].dead is not None:
            return False
        return self._send_to(engine_identity(rank), msg)

    def _send_to(self, identity: bytes, msg: Any) -> bool:
        try:
            self._send_sock.send_multipart([identity, pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)],
                                           flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:  # EHOSTUNREACH: not connected (yet, or any more); EAGAIN: queue full
            logger.warning("could not send %r to %r: %s", msg[0], identity, e)
            return False

    async def poll(self, timeout_ms: int) -> bool:
        return bool(await self.sock.poll(timeout_ms))

    async def recv(self) -> tuple[int | None, tuple]:
        """The next message: (replica rank, message), or (None, message) from a node supervisor, whose
        bookkeeping (heartbeats, replica deaths it reports) happens here and comes back as
        ("node_dead", [(rank, reason)]) when it reports deaths."""
        identity, data = await self.sock.recv_multipart()
        msg = pickle.loads(data)
        rank = rank_of_identity(identity)
        if rank is not None and 0 <= rank < self.size:
            r = self.replicas[rank]
            r.last_heard = time.monotonic()
            if msg[0] == "hello":
                r.connected, r.info = True, dict(msg[1])
                if r.proc is None:
                    logger.info("Data parallel rank %d joined from %s (pid %s)", rank, msg[1].get("host"),
                                msg[1].get("pid"))
            elif msg[0] == "ready":
                r.ready = True
                r.info.update(msg[1])
            return rank, msg
        if identity.startswith(b"node-"):
            return None, self._node_message(identity, msg)
        logger.warning("message from an unknown peer %r ignored", identity)
        return None, ("ignored",)

    def _node_message(self, identity: bytes, msg: tuple) -> tuple:
        if msg[0] == "node":
            problem = self._node_problem(identity, msg[1])
            if problem:
                logger.error("Data parallel node %s (host %s) refused: %s", identity.decode(), msg[1].get("host"),
                             problem)
                self._send_to(identity, ("reject", problem))
                return ("ignored",)
            for rank in msg[1]["ranks"]:
                self.replicas[rank].node = identity
            logger.info("Data parallel node %s (host %s) joined with ranks %s", identity.decode(),
                        msg[1].get("host"), list(msg[1]["ranks"]))
        elif identity not in self._nodes:
            return ("ignored",)  # a refused node's heartbeats
        self._nodes[identity] = time.monotonic()
        self._send_to(identity, ("ack",))
        if msg[0] == "metrics":
            metrics.set_remote_samples(identity.decode(), msg[1])
            return ("ignored",)
        dead = [(rank, f"reported by its node: {why}") for rank, why in msg[1].get("dead", {}).items()] \
            if msg[0] == "heartbeat" else []
        return ("node_dead", dead)

    def _node_problem(self, identity: bytes, hello: dict) -> str | None:
        """Why a node's ranks do not fit this deployment (None: they fit)."""
        if hello.get("size") != self.size:
            return f"it was started with --data-parallel-size {hello.get('size')}, the head with {self.size}"
        for rank in hello["ranks"]:
            if not 0 <= rank < self.size:
                return f"rank {rank} is outside 0..{self.size - 1}"
            r = self.replicas[rank]
            if r.proc is not None:
                return f"rank {rank} runs on the head (--data-parallel-size-local there)"
            if r.node is not None and r.node != identity:
                return f"rank {rank} belongs to node {r.node.decode()} already"
        return None

    # -- shutdown --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        for identity in list(self._nodes):  # first: a node must not take its replicas' exit for a failure
            self._send_to(identity, ("shutdown",))
        for r in self.replicas:
            if r.dead is None and (r.proc is None or r.proc.is_alive()):
                self.send(r.rank, ("shutdown",))
        deadline = time.monotonic() + 10
        for r in self.replicas:
            if r.proc is None:
                continue
            r.proc.join(timeout=max(deadline - time.monotonic(), 0.1))
            if r.proc.is_alive():
                r.proc.terminate()
                r.proc.join(timeout=5)
            if r.proc.pid is not None:
                metrics.mark_process_dead(r.proc.pid)
        self.sock.close(linger=500 if self._nodes else 0)  # the nodes' shutdown messages leave first
        self.ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
