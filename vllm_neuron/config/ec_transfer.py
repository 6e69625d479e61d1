"""`--ec-transfer-config`: vLLM's JSON for encoder-disaggregated (EPD) serving -> `ECTransferConfig`.

Fields keep vLLM's names: `ec_connector` (how embeddings move from an encoder instance to a prefill+decode
instance: `ECSharedStorageConnector`, vLLM's, one file per media item in a folder both see (one machine, or a
shared file system); `ECTcpConnector`, ours, the encoder instance keeps what it encoded in memory and serves it
over the KV connector's pyzmq transport), `ec_role` (`ec_producer`: writes the embeddings it computes, an
encoder instance; `ec_consumer`: reads them, a prefill+decode instance; `ec_both`: both) and
`ec_connector_extra_config`:

* `shared_storage_path` (ECSharedStorageConnector, required): the folder; checked at start-up (a producer must
  be able to write there, a consumer to read);
* `ec_ip` / `ec_port` (ECTcpConnector producer): where it serves (default 127.0.0.1:14590);
  `producers` (ECTcpConnector consumer): the "host:port" of every encoder instance, asked in turn;
  `hold_bytes` (producer, both connectors): what it keeps for consumers, oldest out first (default 1 GiB):
  ECTcpConnector's memory; ECSharedStorageConnector's folder, pruned after each write (every producer
  sharing a folder prunes it as a whole, so it stays within the smallest cap);
* `fetch_timeout_s`: how long a consumer waits for one item (default 10).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

from vllm_neuron.config import validate as V
from vllm_neuron.config.json_object import parse_json_object

CONNECTORS = ("ECSharedStorageConnector", "ECTcpConnector")
ROLES = ("ec_producer", "ec_consumer", "ec_both")
DEFAULT_EC_PORT = 14590
_EXTRA = {"shared_storage_path": None, "ec_ip": "127.0.0.1", "ec_port": DEFAULT_EC_PORT, "producers": [],
          "hold_bytes": 2**30, "fetch_timeout_s": 10.0}
_OWN = {"ECSharedStorageConnector": {"shared_storage_path", "hold_bytes"},
        "ECTcpConnector": {"ec_ip", "ec_port", "producers", "hold_bytes"}}


@dataclass(frozen=True)
class ECTransferConfig:
    ec_connector: str
    ec_role: str
    shared_storage_path: str | None = None
    ec_ip: str = "127.0.0.1"
    ec_port: int = DEFAULT_EC_PORT
    producers: tuple[str, ...] = ()
    hold_bytes: int = 2**30
    fetch_timeout_s: float = 10.0
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def is_producer(self) -> bool:
        return self.ec_role in ("ec_producer", "ec_both")

    @property
    def is_consumer(self) -> bool:
        return self.ec_role in ("ec_consumer", "ec_both")

    def describe(self) -> str:
        where = self.shared_storage_path if self.ec_connector == "ECSharedStorageConnector" else \
            (f"served on {self.ec_ip}:{self.ec_port}" if self.is_producer else "") + \
            (f" reading {', '.join(self.producers)}" if self.is_consumer else "")
        return f"{self.ec_connector}, {self.ec_role}, {where.strip()}"


def parse_ec_transfer_config(value: dict | str | ECTransferConfig | None) -> ECTransferConfig | None:
    """vLLM's --ec-transfer-config JSON (a dict or its text) -> ECTransferConfig; None when unset. Every field is
    checked here; the shared folder is checked by `check_shared_folder` when the engine starts."""
    if value is None or isinstance(value, ECTransferConfig):
        return value
    d = parse_json_object(value, "ec_transfer_config must be a JSON object, got {value!r}: {error}",
                          "ec_transfer_config must be a JSON object, got {value!r}")
    if not d:
        return None
    known = {"ec_connector", "ec_role", "ec_connector_extra_config"}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"ec_transfer_config has unknown field(s) {unknown}; valid fields: {sorted(known)}")
    if "ec_connector" not in d or "ec_role" not in d:
        raise ValueError(f"ec_transfer_config needs ec_connector (one of {list(CONNECTORS)}) and ec_role (one of "
                         f"{list(ROLES)}), got {sorted(d)}")
    connector = V.choice("ec_transfer_config.ec_connector", d["ec_connector"], CONNECTORS)
    role = V.choice("ec_transfer_config.ec_role", d["ec_role"], ROLES)
    extra = parse_json_object(d.get("ec_connector_extra_config") or None,
                              "ec_transfer_config.ec_connector_extra_config must be a JSON object, got {value!r}: "
                              "{error}", "ec_transfer_config.ec_connector_extra_config must be a JSON object, got "
                                         "{value!r}")
    valid = _OWN[connector] | {"fetch_timeout_s"}
    bad = sorted(set(extra) - valid)
    if bad:
        raise ValueError(f"ec_transfer_config.ec_connector_extra_config has key(s) {bad} that {connector} does not "
                         f"take; valid keys: {sorted(valid)}")
    opt = "ec_transfer_config.ec_connector_extra_config."
    path = extra.get("shared_storage_path")
    if connector == "ECSharedStorageConnector" and (not isinstance(path, str) or not path.strip()):
        raise ValueError(f"{opt}shared_storage_path must name a folder for ECSharedStorageConnector, got {path!r}")
    producers = extra.get("producers", [])
    if not isinstance(producers, list) or not all(isinstance(p, str) and ":" in p for p in producers):
        raise ValueError(f"{opt}producers must be a list of \"host:port\" strings, got {producers!r}")
    if connector == "ECTcpConnector" and role == "ec_consumer" and not producers:
        raise ValueError(f"{opt}producers must list the encoder instances (\"host:port\" each) an ECTcpConnector "
                         "consumer reads from")
    for p in producers:
        port = p.rpartition(":")[2]
        V.port(f"{opt}producers", int(port) if port.isdigit() else port)
    return ECTransferConfig(
        ec_connector=connector, ec_role=role, shared_storage_path=os.path.abspath(path) if path else None,
        ec_ip=V.host(f"{opt}ec_ip", extra.get("ec_ip", _EXTRA["ec_ip"])),
        ec_port=V.port(f"{opt}ec_port", extra.get("ec_port", _EXTRA["ec_port"])),
        producers=tuple(producers),
        hold_bytes=V.integer(f"{opt}hold_bytes", extra.get("hold_bytes", _EXTRA["hold_bytes"]), minimum=1),
        fetch_timeout_s=V.number(f"{opt}fetch_timeout_s", extra.get("fetch_timeout_s", _EXTRA["fetch_timeout_s"]),
                                 minimum=0, min_exclusive=True),
        extra=dict(extra))


def check_shared_folder(config: ECTransferConfig) -> None:
    """A start-up error unless the shared folder exists and this role can use it (a producer writes a probe
    file there and removes it; a consumer lists it)."""
    path = config.shared_storage_path
    if path is None:
        return
    opt = "ec_transfer_config.ec_connector_extra_config.shared_storage_path"
    if not os.path.isdir(path):
        raise ValueError(f"{opt}={path!r} is not an existing folder: create it (every encoder and prefill+decode "
                         "instance must see the same folder)")
    if config.is_producer:
        try:
            with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-"):
                pass
        except OSError as e:
            raise ValueError(f"{opt}={path!r} is not writable by this encoder instance ({e.strerror})") from None
    if config.is_consumer and not os.access(path, os.R_OK | os.X_OK):
        raise ValueError(f"{opt}={path!r} is not readable by this instance")
