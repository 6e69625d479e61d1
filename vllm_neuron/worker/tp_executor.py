"""Tensor and pipeline parallelism: one model runner per rank, driven by the engine core through rank 0.

Rank 0 lives in the engine core's process; ranks 1..N-1 are processes of their own (this node's are
started here, other nodes' by `serve --headless`, `run_headless_ranks`). At start-up rank 0 sends every
rank the finalized engine config, and each builds the same runner on its shard of the model. After
that, each runner call the engine core makes (load, KV sizing, warm-up, every step) is broadcast on the
gloo control group and replayed by every rank in the same order, so the ranks run the same bucket graph
on the same inputs; the graphs' collectives keep them in step. Logits are all-gathered inside the graph,
so every rank samples the same token from the same row; only rank 0's result goes back to the engine.
KV pools: each rank sizes its own from its own budget and the smallest count wins (an all-reduce), so
the scheduler's block numbers are valid on every rank.

Pipeline parallelism (distributed/pipeline.py) uses the same protocol over a world of pp x tp ranks: every
rank replays every call, each stage's runner on a model of its own layers, and the stages hand activations
and logits to each other inside the graphs (model/layers/pipeline_ops.py), so the engine core, the scheduler
and the runner see one runner as before. Within a decode step the stages overlap on micro-batches (when
VLLM_NEURON_PP_MICRO_BATCHES > 1); prefill steps, the logits and consecutive steps do not
(model/pipeline_stage.py says why). Each stage sizes the KV of its own layers; the smallest pool over every
rank wins as for TP.

Failure: a follower that exits (watched by a thread) or a collective that fails or times out
(VLLM_NEURON_DIST_TIMEOUT_S) raises `WorkerRankError`, which the engine core treats as fatal: its
requests fail with that message and the server reports itself unhealthy.
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

import torch

from vllm_neuron.config.engine_config import EngineConfig
from vllm_neuron.distributed import parallel_state as ps
from vllm_neuron.distributed import pipeline
from vllm_neuron.frame_stack import call_with_room
from vllm_neuron.logger import init_logger
from vllm_neuron.proc_lifecycle import before_exit, install_stack_dumps
from vllm_neuron.worker.runner_factory import create_runner

logger = init_logger(__name__)

# Runner calls whose result is reduced over the ranks (min): the KV pool every rank can hold.
# Calls whose result is the minimum over the ranks (an int, or a list of ints element by element: kv_poll_loads'
# per-request state, so a load counts as read only when every rank read its heads; stop_profile: 1 once a rank's
# trace is written, so rank 0 returns when every rank's is).
_MIN_REDUCED = ("num_blocks", "kv_poll_loads", "kv_tier_poll", "stop_profile")
# Read-only queries rank 0 answers alone: the engine core asks some of them from its own thread while a step is in
# flight on the step thread (async scheduling: the step's stats), and a second broadcast on the control group then
# would interleave with the step's and corrupt both.
_RANK0_ONLY = ("encoder_cache_stats", "prefill_needs_context", "prefill_reads_block_tables", "request_blocks")


class WorkerRankError(RuntimeError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on."""


@dataclass(frozen=True)
class RankSetup:
    """What a rank needs to join the group before it knows anything else."""

    world: int
    nnodes: int
    master_addr: str
    master_port: int
    ep_degree: int
    timeout_s: float
    replicas_on_node: int = 1  # data-parallel replicas sharing this node's cores
    pp: int = 1  # pipeline stages: world = tp x pp

    @property
    def local_ranks(self) -> int:
        return self.world // self.nnodes

    def node_ranks(self, node_rank: int) -> range:
        return pipeline.node_ranks(node_rank, self.world, self.nnodes)

    @classmethod
    def of(cls, config: EngineConfig) -> "RankSetup":
        from vllm_neuron import envs

        # One node: the group meets on a free loopback port (--master-port matters across nodes only).
        addr, port = (config.master_addr, config.master_port) if config.nnodes > 1 else ("127.0.0.1", _free_port())
        return cls(config.world_size, config.nnodes, addr, port, config.neuron_config.ep_degree or 1,
                   envs.VLLM_NEURON_DIST_TIMEOUT_S, config.kv_budget_shared_by, config.pipeline_parallel_size)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(setup: RankSetup, rank: int) -> int:
    threads = ps.set_rank_threads(setup.local_ranks * setup.replicas_on_node)
    ps.init(rank, setup.world, setup.master_addr, setup.master_port, device_type="cpu",
            ep_degree=setup.ep_degree, timeout_s=setup.timeout_s, pp_size=setup.pp)
    return threads


def _send(obj: Any, timeout_s: float | None = None) -> None:
    """Rank 0: broadcasts `obj` to the other ranks. A gloo broadcast waits for its receivers, and theirs waits
    for as long as the engine is idle (no timeout on the control group), so rank 0 bounds its own wait:
    a step's inputs that a rank does not take within `timeout_s` mean that rank hangs."""
    import time

    import torch.distributed as dist

    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    size = torch.tensor([len(data)], dtype=torch.int64)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    works = [dist.broadcast(t, src=0, group=ps.control_group(), async_op=True) for t in (size, payload)]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for work in works:
        while deadline is not None and not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"a rank did not take the step's inputs within {timeout_s:g} s (timed out)")
            time.sleep(0.0002)
        work.wait()


def _recv() -> Any:
    """A follower: the next object rank 0 broadcasts (_send)."""
    import torch.distributed as dist

    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=ps.control_group())
    payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=ps.control_group())
    return pickle.loads(payload.numpy().tobytes())


def _min_over_ranks(value: int | list[int]) -> int | list[int]:
    import torch.distributed as dist

    t = torch.tensor(value if isinstance(value, list) else [value], dtype=torch.int64)
    if t.numel():
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ps.control_group())
    return t.tolist() if isinstance(value, list) else int(t.item())


class TPExecutor:
    """Rank 0: stands in for the runner (same methods); each call runs on every rank."""

    def __init__(self, config: EngineConfig, ckpt, device: torch.device, dtype: torch.dtype, backend: str) -> None:
        self.setup = RankSetup.of(config)
        self._threads_before = torch.get_num_threads()
        _check_shardable(ckpt.hf_config, config.tensor_parallel_size)
        text = ckpt.hf_config.get_text_config()
        pipeline.check_pipeline_model(self.setup.pp, getattr(ckpt.hf_config, "architectures", None),
                                      getattr(text, "num_hidden_layers", 0))
        # This node's other ranks (node 0 holds ranks 0 .. local_ranks - 1).
        self.procs = [_start_rank(self.setup, r) for r in self.setup.node_ranks(0)[1:]]
        self._failure: str | None = None
        self._closed = False
        try:
            threads = _join(self.setup, 0)
        except Exception as e:
            self._stop_procs()
            raise WorkerRankError(f"tensor parallel group did not form at {self.setup.master_addr}:"
                                  f"{self.setup.master_port}: "
                                  f"{e}") from e
        logger.info("Tensor parallel: %d ranks (%d pipeline stage(s) of %d; %d node(s), %d on this node, %d "
                    "thread(s) each; follower pids %s), ep_degree %d, collectives on gloo", self.setup.world,
                    self.setup.pp, self.setup.world // self.setup.pp, self.setup.nnodes, self.setup.local_ranks,
                    threads, [p.pid for p in self.procs], self.setup.ep_degree)
        self._watch = threading.Thread(target=self._watch_followers, name="vllm-neuron-tp-watch", daemon=True)
        self._watch.start()
        atexit.register(self.shutdown)  # before multiprocessing's exit handler joins the followers
        self._call(_send, (config, device, dtype, backend))
        _set_micro_batches(config)
        self.runner = create_runner(config, ckpt, device, dtype, backend)

    @property
    def follower_pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _watch_followers(self) -> None:
        import time

        while not self._closed and self._failure is None and not self._dead_follower():
            time.sleep(0.5)

    def _dead_follower(self) -> bool:
        """Records the first of this node's ranks that exited (True when one did)."""
        for rank, p in enumerate(self.procs, 1):
            if p.poll() is not None and not self._closed:
                if self._failure is None:
                    self._failure = f"tensor parallel rank {rank} (pid {p.pid}) exited with code {p.returncode}"
                    logger.error("%s", self._failure)
                return True
        return False

    def _call(self, fn, *args):
        """Runs one step of the group protocol, turning a broken group into WorkerRankError."""
        if self._failure is not None:
            raise WorkerRankError(self._failure)
        try:
            return fn(*args)
        except Exception as e:
            if self._failure is not None or _is_group_failure(e):
                import time

                time.sleep(0.5)  # a local rank that died has exited by now: name it
                self._dead_follower()
                reason = self._failure or f"a rank died or hung (a collective failed: {type(e).__name__}: {e})"
                self._failure = reason
                raise WorkerRankError(f"{reason}; the tensor parallel group is broken, the engine stops") from e
            raise

    def warmup(self, progress=None):
        """Warm-up on every rank; rank 0 alone reports progress (a callback does not cross processes)."""
        self._call(_send, ("warmup", ()))
        return self._call(self.runner.warmup, progress)

    def __getattr__(self, name: str):
        attr = getattr(self.runner, name)
        if not callable(attr) or name in _RANK0_ONLY:
            return attr

        def on_every_rank(*args):
            # Steps are bounded (a rank that does not take them hangs); set-up calls such as warm-up are not.
            self._call(_send, (name, args), self.setup.timeout_s if name == "execute" else None)
            result = self._call(attr, *args)
            if name in _MIN_REDUCED:
                result = self._call(_min_over_ranks, result)
            return result

        return on_every_rank

    def close(self) -> None:
        """The runner's close on every rank; once the group is shut down (atexit may come first), rank 0's only."""
        if not self._closed and self._failure is None:
            self._call(_send, ("close", ()), self.setup.timeout_s)
        self.runner.close()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            try:
                _send(None, self.setup.timeout_s)
            except Exception:  # noqa: BLE001 - followers gone already
                pass
        ps.shutdown()
        self._stop_procs()
        torch.set_num_threads(self._threads_before)

    def _stop_procs(self) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)


def _start_rank(setup: RankSetup, rank: int) -> subprocess.Popen:
    """A follower rank as a process of its own (`python -m vllm_neuron.worker.tp_executor`): the server's engine
    core is a daemonic multiprocessing child, which multiprocessing does not let have children."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen([sys.executable, "-m", "vllm_neuron.worker.tp_executor", json.dumps(asdict(setup)),
                             str(rank)], env=env)


def _set_micro_batches(config: EngineConfig) -> None:
    ps.set_info(dataclasses.replace(ps.info(), pp_micro_batches=config.pp_micro_batches))


def _check_shardable(hf_config, tp: int) -> None:
    """The head-split rules, before any process starts (parallel_state.local_kv_heads); which models shard at all
    is config/compatibility.py's to say."""
    heads = getattr(hf_config, "num_attention_heads", None)
    if heads:
        ps.check_tp_divides("the number of attention heads", heads, tp)
        ps.local_kv_heads(getattr(hf_config, "num_key_value_heads", None) or heads, tp)


def _is_group_failure(e: BaseException) -> bool:
    """A collective's failure (peer gone, timeout) rather than an error of the step's own."""
    import torch.distributed as dist

    if isinstance(e, (dist.DistError, TimeoutError)):
        return True
    text = str(e).lower()
    return any(s in text for s in ("gloo", "connection closed", "connection reset", "timed out", "broken pipe"))


def _replay(runner, rank: int) -> None:
    """Rank 0's runner calls, in order, until it says stop."""
    while True:
        msg = _recv()
        if msg is None:
            break
        name, args = msg
        try:
            result = getattr(runner, name)(*args)
        except Exception as e:  # noqa: BLE001 - rank 0 saw the same error; it decides
            if _is_group_failure(e):
                raise
            logger.warning("rank %d: %s failed like on rank 0: %s", rank, name, e)
            result = [0] * len(args[0]) if name == "kv_poll_loads" else 0
        if name in _MIN_REDUCED:
            _min_over_ranks(result)


def follower_main(setup: RankSetup, rank: int) -> None:
    """A rank other than 0: joins, builds its runner from rank 0's config, replays rank 0's calls."""
    install_stack_dumps()  # a rank stuck in a collective shows where with `kill -USR1`
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the head decides when the group ends
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    os.environ.setdefault("VLLM_NEURON_TP_RANK", str(rank))
    _join(setup, rank)
    try:
        config, device, dtype, backend = _recv()
        from vllm_neuron.model.loader import load_checkpoint

        _set_micro_batches(config)  # rank 0's choice, whatever this node's environment says
        runner = create_runner(config, load_checkpoint(config.model), device, dtype, backend)
        # Under a frame stack chunk of its own: no call maps and unmaps frame memory (frame_stack.py).
        call_with_room(_replay, runner, rank)
    except Exception as e:  # noqa: BLE001
        logger.error("tensor parallel rank %d stops: %s\n%s", rank, e, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        ps.shutdown()
        before_exit()


def _exit_with_parent(parent: int) -> None:
    """A rank whose parent (the engine core, or a headless node's process) is gone has no one to serve."""
    import time

    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def run_headless_ranks(config: EngineConfig) -> int:
    """`serve --headless --nnodes N --node-rank K`: this node's ranks of a multi-node tensor-parallel
    engine (no API server); returns when they end (the head shut down or failed)."""
    if config.nnodes < 2 or config.node_rank < 1:
        raise ValueError("--headless with tensor parallelism runs the ranks of a follower node: it needs --nnodes > 1 "
                         "and --node-rank >= 1 (node 0 runs the API server)")
    setup = RankSetup.of(config)
    ranks = setup.node_ranks(config.node_rank)
    procs = [_start_rank(setup, r) for r in ranks]
    logger.info("Headless node %d: tensor parallel ranks %d..%d (of %d: %d pipeline stage(s); pids %s) join %s:%d",
                config.node_rank, ranks[0], ranks[-1], setup.world, setup.pp, [p.pid for p in procs],
                config.master_addr, config.master_port)
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    follower_main(RankSetup(**json.loads(sys.argv[1])), int(sys.argv[2]))
