"""`NixlConnector`'s transport: NIXL (the `nixl` package, its UCX backend) reads KV blocks straight out of the
prefill rank's registered host memory into the reader's own blocks; no copy through a socket.

Every rank registers its K/V tensors with a NIXL agent of its own (memory type DRAM). The prefill rank's block
server (tcp.py, the side channel of both transports) answers `nixl_meta` after the same checks as `read` (the
request key, its secret, the engine id, blocks among those held): the agent's metadata (when the reader asks
for it) and where each tensor starts. The reader adds the remote agent once per source address (again when the
source restarted under a new agent), builds READ descriptors from the source blocks to its local ones (one per
block and tensor when the rows are whole, one per slot when it takes a sub-range of the heads: tensor-parallel
sizes differ), runs the transfer to DONE within `fetch_timeout_s`, and asks `nixl_meta` once more: the hold
still stood when the read ended, so the blocks were not freed and reused while they were read.
"""
from __future__ import annotations

import json
import time
import uuid

import numpy as np

from vllm_neuron.distributed.kv_transfer.block_io import KVPairs
from vllm_neuron.distributed.kv_transfer.head_split import HeadSlice
from vllm_neuron.distributed.kv_transfer.tcp import BlockClient, TransferError
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

PIP_HINT = "pip install nixl (or pip install 'vllm-neuron[nixl]')"
_POLL_S = 0.0002


def import_nixl():
    """nixl's agent classes; a missing or broken install is a ValueError naming the install command."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:
        raise ValueError(f"kv_transfer_config.kv_connector 'NixlConnector' needs the nixl package: {PIP_HINT} "
                         f"({e}); or use 'TcpConnector', which needs nothing more") from e
    return nixl_agent, nixl_agent_config


def block_descs(bases: list[int], heads: int, head_bytes: int, block_size: int, blocks: list[int],
                head_start: int, count: int, whole: bool) -> np.ndarray:
    """NIXL's Nx3 descriptor rows (address, length, device 0): for each tensor (base address) and block in
    order, heads [head_start, head_start + count) of the block's slots; one row per block when `whole` (the
    rows are read entire), else one per slot."""
    row = heads * head_bytes
    base = np.asarray(bases, dtype=np.uint64)[:, None]
    b = np.asarray(blocks, dtype=np.uint64)
    if whole:
        addr, length = base + b[None, :] * np.uint64(block_size * row), block_size * row
    else:
        slots = (b[:, None] * np.uint64(block_size) + np.arange(block_size, dtype=np.uint64)[None, :]).ravel()
        addr, length = base + slots[None, :] * np.uint64(row) + np.uint64(head_start * head_bytes), count * head_bytes
    out = np.zeros((addr.size, 3), dtype=np.uint64)
    out[:, 0], out[:, 1] = addr.ravel(), length
    return out


class NixlAgent:
    """This rank's NIXL agent over its K/V tensors: the source's answer to `nixl_meta`, the reader's `read`."""

    def __init__(self, kv: KVPairs, block_size: int, engine_id: str, tp_rank: int) -> None:
        nixl_agent, nixl_agent_config = import_nixl()
        self.tensors = [t for pair in kv for t in pair]
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in self.tensors):
            raise ValueError("kv_transfer_config.kv_connector 'NixlConnector' moves host memory (DRAM) here; this "
                             "KV cache is not on the CPU: use 'TcpConnector'")
        self.name = f"{engine_id}-tp{tp_rank}-{uuid.uuid4().hex[:8]}"
        try:
            # The progress thread stays: without it a READ between two agents never completes (the source must
            # progress too). It costs about a quarter of a core per idle agent (measured), until close().
            self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
            if "UCX" not in self.agent.backends:
                raise RuntimeError(f"no UCX backend (plugins: {self.agent.get_plugin_list()})")
            self._reg = self.agent.register_memory(self.tensors)
            self._metadata = self.agent.get_agent_metadata()
        except Exception as e:  # noqa: BLE001 - the bindings raise their own types; any means NIXL cannot serve
            raise ValueError(f"kv_transfer_config.kv_connector 'NixlConnector': NIXL could not start here "
                             f"({type(e).__name__}: {e}); use 'TcpConnector'") from e
        t = self.tensors[0]
        self.block_size, self.heads = block_size, t.shape[1]
        self.layout = {"agent": self.name, "bases": [x.data_ptr() for x in self.tensors],
                       "heads": self.heads,
                       "head_bytes": t.shape[2] * t.element_size(), "block_size": block_size,
                       "dtype": str(t.dtype).removeprefix("torch.")}
        self.remote_agents: dict[str, str] = {}  # source address -> the agent added for it

    # -- a prefill rank: the block server's `nixl_meta` -----------------------------------------------------
    def meta_reply(self, req: dict, groups: list[list[int]], start: int, count: int) -> list:
        header = json.dumps({"ok": True, **self.layout}).encode()
        return [header, self._metadata] if req.get("metadata") else [header]

    # -- a decode rank ------------------------------------------------------------------------------------
    def read(self, client: BlockClient, address: str, request: dict, pairs: list[tuple[list[int], list[int]]],
             part: HeadSlice, timeout_s: float) -> int:
        """Reads heads `part` of the source blocks into the local ones (`pairs`: per KV cache group, source and
        local block ids in step) from the source rank at `address`; `request` names the hold (key, secret,
        engine_id). Returns the bytes read; TransferError when anything refuses or fails."""
        ask = {"op": "nixl_meta", **request, "groups": [r for r, _ in pairs], "heads": [part.src_start, part.count]}
        src, remote = self._source(client, address, ask, timeout_s)
        whole = part.count == src["heads"] == self.heads
        src_rows = np.concatenate([block_descs(src["bases"], src["heads"], src["head_bytes"], self.block_size, r,
                                               part.src_start, part.count, whole) for r, _ in pairs])
        dst_rows = np.concatenate([block_descs(self.layout["bases"], self.heads, self.layout["head_bytes"],
                                               self.block_size, loc, part.dst_start, part.count, whole)
                                   for _, loc in pairs])
        self._transfer(dst_rows, src_rows, remote, address, timeout_s)
        client.call(address, {**ask, "metadata": False}, timeout_s)  # raises when the hold went meanwhile
        return int(dst_rows[:, 1].sum())

    def _source(self, client: BlockClient, address: str, ask: dict, timeout_s: float) -> tuple[dict, str]:
        """The source's layout (checked against ours) and its agent's name, added when new."""
        known = self.remote_agents.get(address)
        reply, *frames = client.call(address, {**ask, "metadata": known is None}, timeout_s)
        if reply.get("agent") != known:
            if not frames:  # the source restarted under a new agent since we added its last one
                reply, *frames = client.call(address, {**ask, "metadata": True}, timeout_s)
            if not frames:
                raise TransferError(f"{address} sent no NIXL metadata")
            try:
                if known is not None:
                    self.agent.remove_remote_agent(known)
                    del self.remote_agents[address]
                name = self.agent.add_remote_agent(frames[0].bytes)
                name = name.decode() if isinstance(name, bytes) else name  # nixl 1.5.1 returns bytes
            except Exception as e:  # noqa: BLE001 - the bindings' own error types
                raise TransferError(f"NIXL could not add {address}'s agent: {type(e).__name__}: {e}") from e
            if name != reply.get("agent"):
                raise TransferError(f"{address}'s metadata names agent {name!r}, its reply {reply.get('agent')!r}")
            self.remote_agents[address] = name
        mine = {k: self.layout[k] for k in ("head_bytes", "block_size", "dtype")}
        if {k: reply.get(k) for k in mine} != mine or len(reply.get("bases") or []) != len(self.tensors):
            raise TransferError(f"{address}'s KV cache ({len(reply.get('bases') or [])} tensors, "
                                f"{ {k: reply.get(k) for k in mine} }) does not match this one's "
                                f"({len(self.tensors)} tensors, {mine})")
        return reply, reply["agent"]

    def _transfer(self, dst_rows: np.ndarray, src_rows: np.ndarray, remote: str, address: str,
                  timeout_s: float) -> None:
        # The bindings raise their own Exception subclasses (nixlRemoteDisconnectError when the source dies...):
        # each is this read's failure, never the reader thread's.
        handle, state = None, "ERR"
        try:
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(dst_rows, "DRAM"),
                                                self.agent.get_xfer_descs(src_rows, "DRAM"), remote)
            deadline = time.monotonic() + timeout_s
            state = self.agent.transfer(handle)
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(_POLL_S)
                state = self.agent.check_xfer_state(handle)
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"NIXL READ from {address}: {type(e).__name__}: {e}") from e
        finally:
            if handle is not None:
                try:
                    self.agent.release_xfer_handle(handle)  # cancels one still in progress
                except Exception as e:  # noqa: BLE001
                    logger.warning("NIXL READ from %s: its handle could not be released (%s: %s)", address,
                                   type(e).__name__, e)
        if state != "DONE":
            raise TransferError(f"NIXL READ from {address}: " + (f"not done within {timeout_s:g} s"
                                                                 if state == "PROC" else f"state {state}"))

    def close(self) -> None:
        for name in self.remote_agents.values():
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - a source gone first; nothing to disconnect
                pass
        self.remote_agents.clear()
        self.agent.deregister_memory(self._reg)
        self.agent = None  # the agent's threads and UCX context end with it
