"""`--kv-transfer-config`: vLLM's JSON for disaggregated prefill/decode -> `KVTransferConfig` (pure).

Fields keep vLLM's names: `kv_connector` (which transport moves the KV blocks: `TcpConnector`, ours, pyzmq frames
over TCP, which needs nothing beyond the base install; or vLLM's `NixlConnector`, NIXL over UCX from the prefill
instance's registered host memory, which needs the optional `nixl` package: `pip install nixl`, refused at
start-up without it), `kv_role` (`kv_producer`: a prefill instance that holds a finished prompt's blocks
for a decode instance to read; `kv_consumer`: a decode instance that reads them; `kv_both`: either, per
request), `kv_rank` and `kv_parallel_size` (accepted as vLLM's; each instance is addressed by the
`kv_transfer_params` of the request instead), `kv_ip` / `kv_port` (where this instance serves its blocks, and
with NixlConnector its NIXL metadata; tensor-parallel rank r of data-parallel replica d listens on
`kv_port + d * tensor_parallel_size + r`),
`engine_id` (names this instance in `kv_transfer_params`; default: a fresh id per start) and
`kv_connector_extra_config` (`hold_timeout_s`: how long a prefill instance keeps a finished prompt's blocks
for a reader that does not come, default 120; `advertise_host`: the host decode instances are told to reach
when it differs from `kv_ip`, e.g. 0.0.0.0 bound behind a routable name; `fetch_timeout_s`: how long a decode
instance waits for one transfer, default 30). A NixlConnector prefill instance serves TcpConnector readers too;
a NixlConnector reader of a TcpConnector instance prefills locally (counted as a recompute).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import uuid
from dataclasses import dataclass, field
from typing import Any

from vllm_neuron.config import validate as V
from vllm_neuron.config.json_object import parse_json_object

CONNECTORS = ("TcpConnector", "NixlConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_KV_PORT = 14579  # vLLM's
_EXTRA_KEYS = {"hold_timeout_s": 120.0, "fetch_timeout_s": 30.0, "advertise_host": None}
# vLLM fields of other connectors (buffers of NCCL-style ones): accepted when they say nothing we would ignore.
_IGNORABLE = {"kv_buffer_device": ("cpu", "cuda"), "kv_buffer_size": None, "kv_connector_module_path": (None,)}


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    engine_id: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = DEFAULT_KV_PORT
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    hold_timeout_s: float = 120.0
    fetch_timeout_s: float = 30.0
    advertise_host: str | None = None
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def port_of(self, dp_rank: int, tp_size: int, tp_rank: int) -> int:
        """Where tensor-parallel rank `tp_rank` of data-parallel replica `dp_rank` serves its blocks."""
        return self.kv_port + dp_rank * tp_size + tp_rank

    @property
    def host(self) -> str:
        """The host a decode instance is told to reach."""
        return self.advertise_host or self.kv_ip

    def describe(self) -> str:
        return (f"{self.kv_connector}, {self.kv_role}, engine {self.engine_id}, blocks served on "
                f"{self.host}:{self.kv_port}+")


def nixl_installed() -> bool:
    """Whether the optional `nixl` package is there (found, not imported: importing it loads its libraries)."""
    return importlib.util.find_spec("nixl") is not None


def parse_kv_transfer_config(value: dict | str | KVTransferConfig | None) -> KVTransferConfig | None:
    """vLLM's --kv-transfer-config JSON (a dict or its text) -> KVTransferConfig; None when unset. Every field
    is checked here, where the option enters; an unknown field is refused by name."""
    if value is None or isinstance(value, KVTransferConfig):
        return value
    d = parse_json_object(value, "kv_transfer_config must be a JSON object, got {value!r}: {error}",
                          "kv_transfer_config must be a JSON object, got {value!r}")
    if not d:
        return None
    known = {f.name for f in dataclasses.fields(KVTransferConfig)} - {"hold_timeout_s", "fetch_timeout_s",
                                                                       "advertise_host", "extra"}
    unknown = sorted(set(d) - known - {"kv_connector_extra_config"} - set(_IGNORABLE))
    if unknown:
        raise ValueError(f"kv_transfer_config has unknown field(s) {unknown}; valid fields: "
                         f"{sorted(known | {'kv_connector_extra_config'})}")
    for name, allowed in _IGNORABLE.items():
        if name in d and allowed is not None and d[name] not in allowed:
            raise V.not_supported(f"kv_transfer_config.{name}", d[name],
                                  f"the blocks move between the instances' own KV pools; valid values: {list(allowed)}")
    if "kv_connector" not in d or "kv_role" not in d:
        raise ValueError(f"kv_transfer_config needs kv_connector (one of {list(CONNECTORS)}) and kv_role (one of "
                         f"{list(ROLES)}), got {sorted(d)}")
    connector = V.choice("kv_transfer_config.kv_connector", d["kv_connector"], CONNECTORS)
    if connector == "NixlConnector" and not nixl_installed():
        raise ValueError("kv_transfer_config.kv_connector 'NixlConnector' needs the nixl package, which is not "
                         "installed: pip install nixl (or pip install 'vllm-neuron[nixl]'); or use 'TcpConnector', "
                         "which needs nothing more")
    role = V.choice("kv_transfer_config.kv_role", d["kv_role"], ROLES)
    extra = parse_json_object(d.get("kv_connector_extra_config") or None,
                              "kv_transfer_config.kv_connector_extra_config must be a JSON object, got {value!r}: "
                              "{error}", "kv_transfer_config.kv_connector_extra_config must be a JSON object, got "
                                         "{value!r}")
    bad = sorted(set(extra) - set(_EXTRA_KEYS))
    if bad:
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config has unknown key(s) {bad}; valid keys: "
                         f"{sorted(_EXTRA_KEYS)}")
    engine_id = d.get("engine_id")
    if engine_id is not None and (not isinstance(engine_id, str) or not engine_id):
        raise ValueError(f"kv_transfer_config.engine_id must be a non-empty string, got {engine_id!r}")
    advertise = extra.get("advertise_host")
    return KVTransferConfig(
        kv_connector=connector, kv_role=role, engine_id=engine_id or f"vllm-neuron-{uuid.uuid4().hex[:12]}",
        kv_ip=V.host("kv_transfer_config.kv_ip", d.get("kv_ip", "127.0.0.1")),
        kv_port=V.port("kv_transfer_config.kv_port", d.get("kv_port", DEFAULT_KV_PORT)),
        kv_rank=V.optional_integer("kv_transfer_config.kv_rank", d.get("kv_rank"), minimum=0),
        kv_parallel_size=V.integer("kv_transfer_config.kv_parallel_size", d.get("kv_parallel_size", 1), minimum=1),
        hold_timeout_s=V.number("kv_transfer_config.kv_connector_extra_config.hold_timeout_s",
                                extra.get("hold_timeout_s", _EXTRA_KEYS["hold_timeout_s"]), minimum=0,
                                min_exclusive=True),
        fetch_timeout_s=V.number("kv_transfer_config.kv_connector_extra_config.fetch_timeout_s",
                                 extra.get("fetch_timeout_s", _EXTRA_KEYS["fetch_timeout_s"]), minimum=0,
                                 min_exclusive=True),
        advertise_host=None if advertise is None else V.host(
            "kv_transfer_config.kv_connector_extra_config.advertise_host", advertise),
        extra=dict(extra))


def parse_kv_transfer_params(value: Any) -> dict | None:
    """A request's `kv_transfer_params` (vLLM's object) checked for shape: a JSON object whose fields have the
    types vLLM's protocol gives them; anything else is a ValueError naming the field. None when absent."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {type(value).__name__}")
    types = {"do_remote_decode": bool, "do_remote_prefill": bool, "remote_engine_id": str, "remote_request_id": str,
             "remote_host": str, "remote_port": int, "remote_block_ids": list, "tp_size": int,
             "remote_num_tokens": int, "remote_secret": str}
    for name, v in value.items():
        t = types.get(name)
        if t is None or v is None:
            continue  # vLLM sends null for what it does not know yet; fields of other connectors pass through
        if not isinstance(v, t) or (t is int and isinstance(v, bool)):
            raise ValueError(f"kv_transfer_params.{name} must be {t.__name__}, got {v!r}")
    blocks = value.get("remote_block_ids")
    if blocks is not None:
        groups = blocks if blocks and isinstance(blocks[0], list) else [blocks]
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for g in groups for b in g):
            raise ValueError("kv_transfer_params.remote_block_ids must be block ids (non-negative integers), "
                             "or one list of them per KV cache group")
    port = value.get("remote_port")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params.remote_port must be a TCP port, got {port}")
    return dict(value)
