"""`serve --headless`: a node that runs data-parallel replicas for the head's API server.

The node spawns its replicas (ranks data_parallel_start_rank .. + data_parallel_size_local - 1), which
connect straight to the head's socket at tcp://data_parallel_address:data_parallel_rpc_port and take
requests from its router. This process stays as their supervisor: it tells the head which ranks it
runs, then sends a heartbeat every HEARTBEAT_S with the replicas that died (and why), so that the head
fails their requests and reports them, and every METRICS_S its replicas' metrics, which the head's
/metrics merges with its own. It exits when the head says shutdown, when the head refuses its
ranks (taken, or another --data-parallel-size), when the head stops answering for NODE_TIMEOUT_S after
it had answered once, on SIGTERM / SIGINT, or when every replica died.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import time

import zmq

from vllm_neuron import metrics
from vllm_neuron.config.engine_args import EngineArgs
from vllm_neuron.engine.core_client import HEARTBEAT_S, NODE_TIMEOUT_S
from vllm_neuron.engine.core_proc import spawn_replica
from vllm_neuron.engine.replica import host_placements
from vllm_neuron.engine.resolve import resolve_engine_config
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

METRICS_S = 2.0  # how often the node sends its replicas' metrics to the head


def run_headless(args: EngineArgs) -> int:
    """Runs this node's replicas until the head lets them go; the exit code (0: the head shut down). The
    node received the options, so it resolves them (for its own replicas' share of its memory)."""
    if args.data_parallel_size < 2 or not args.multi_node_dp:
        raise ValueError("--headless runs some of the replicas of a multi-node data parallel deployment: it needs "
                         "--data-parallel-size > 1 and --data-parallel-size-local below it (this node's replicas)")
    if args.local_dp_replicas < 1:
        raise ValueError("--headless needs --data-parallel-size-local >= 1 (the replicas this node runs)")
    config, _ = resolve_engine_config(args)
    ranks = range(config.data_parallel_start_rank, config.data_parallel_start_rank + config.local_dp_replicas)
    address = f"tcp://{config.data_parallel_address}:{config.data_parallel_rpc_port}"
    model_name = config.served_names()[0]
    stop = {"signal": None}

    def _on_signal(signum, _frame) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    procs = {p.rank: spawn_replica(config, address, p, model_name) for p in host_placements(config, ranks)}
    logger.info("Headless node: data parallel ranks %s (pids %s) serve the head at %s", list(ranks),
                [p.pid for p in procs.values()], address)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"node-%d" % ranks.start)
    sock.setsockopt(zmq.LINGER, 500)
    sock.connect(address)
    try:
        return _supervise(sock, procs, ranks, config.data_parallel_size, stop)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.terminate()
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        sock.close()
        ctx.term()


def _supervise(sock: zmq.Socket, procs: dict, ranks: range, size: int, stop: dict) -> int:
    def send(msg: tuple) -> None:
        sock.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))

    send(("node", {"ranks": list(ranks), "size": size, "host": socket.gethostname(), "pid": os.getpid()}))
    dead: dict[int, str] = {}
    last_ack: float | None = None
    next_beat = next_metrics = 0.0
    while stop["signal"] is None:
        now = time.monotonic()
        for rank, p in procs.items():
            if rank not in dead and not p.is_alive():
                dead[rank] = f"process exited with code {p.exitcode}"
                metrics.mark_process_dead(p.pid)  # its live gauges stop counting
                logger.error("Data parallel replica %d died (%s); reported to the head", rank, dead[rank])
        if now >= next_beat:
            send(("heartbeat", {"dead": dict(dead)}))
            next_beat = now + HEARTBEAT_S
        if now >= next_metrics:  # the head's /metrics shows this node's replicas too
            send(("metrics", metrics.metrics_response_body().decode()))
            next_metrics = now + METRICS_S
        if len(dead) == len(procs):
            time.sleep(HEARTBEAT_S)  # the head gets the report before the node goes
            send(("heartbeat", {"dead": dict(dead)}))
            logger.error("Every replica of this node died; exiting")
            return 1
        if last_ack is not None and now - last_ack > NODE_TIMEOUT_S:
            logger.error("The head stopped answering for %.0f s; stopping this node's replicas", NODE_TIMEOUT_S)
            return 1
        if sock.poll(int(HEARTBEAT_S * 1000 / 4)):
            msg = pickle.loads(sock.recv())
            if msg[0] == "ack":
                last_ack = time.monotonic()
            elif msg[0] == "reject":
                logger.error("The head refused this node: %s", msg[1])
                return 2
            elif msg[0] == "shutdown":
                logger.info("The head shut down; stopping this node's replicas")
                return 0
    logger.info("Signal %s: stopping this node's replicas", stop["signal"])
    return 0
