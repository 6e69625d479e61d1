"""`serve`'s options for the HTTP side, as vLLM names them, checked before anything loads: TLS (--ssl-keyfile,
--ssl-certfile, --ssl-ca-certs, --ssl-cert-reqs), --root-path, CORS (--allowed-origins / -methods / -headers,
--allow-credentials), request logs (--enable-log-requests, --max-log-len, --enable-log-outputs), uvicorn's log
level and access log, and the web UI (--disable-webui). `HttpOptions` turns them into build_app's and uvicorn's
keyword arguments.

A wrong TLS file is a start-up error naming the flag and the file (uvicorn would find out only after the engine's
warm-up, in a traceback); so is a flag that would have no effect (--ssl-ca-certs without HTTPS, --max-log-len
without --enable-log-requests).
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import ssl
from dataclasses import dataclass
from typing import Any

from vllm_neuron.entrypoints.openai.request_logger import RequestLogger

CERT_REQS = {0: "none (ssl.CERT_NONE)", 1: "optional (ssl.CERT_OPTIONAL)", 2: "required (ssl.CERT_REQUIRED)"}
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def list_option(option: str, values: list[str] | None) -> list[str]:
    """A CORS list as vLLM takes it (one JSON list, '["GET", "POST"]') or as separate words (GET POST); None: ["*"]."""
    if not values:
        return ["*"]
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            parsed = json.loads(values[0])
        except json.JSONDecodeError as e:
            raise ValueError(f"{option}: {values[0]!r} is not a JSON list ({e.msg})") from None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"{option} must be a JSON list of strings, got {values[0]!r}")
        return parsed
    return list(values)


def _readable(option: str, path: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"{option} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{option} {path}: not readable by this user")


def check_tls_files(certfile: str | None, keyfile: str | None, ca_certs: str | None) -> None:
    """Loads the files as uvicorn will, so that a wrong one fails here, named."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    if certfile is not None:
        _readable("--ssl-certfile", certfile)
        try:
            ctx.load_verify_locations(cafile=certfile)  # parses the certificate(s) alone
        except (ssl.SSLError, ValueError) as e:
            raise ValueError(f"--ssl-certfile {certfile}: not a PEM certificate ({e})") from None
    if keyfile is not None:
        _readable("--ssl-keyfile", keyfile)
    if certfile is not None:
        try:
            ctx.load_cert_chain(certfile, keyfile)
        except ssl.SSLError as e:
            where = f"--ssl-keyfile {keyfile}" if keyfile else f"--ssl-certfile {certfile} (no --ssl-keyfile given)"
            raise ValueError(f"{where}: not a PEM private key matching the certificate in --ssl-certfile ({e})") \
                from None
    if ca_certs is not None:
        _readable("--ssl-ca-certs", ca_certs)
        try:
            ctx.load_verify_locations(cafile=ca_certs)
        except (ssl.SSLError, ValueError) as e:
            raise ValueError(f"--ssl-ca-certs {ca_certs}: not PEM CA certificates ({e})") from None


@dataclass(frozen=True)
class HttpOptions:
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE: no client certificate asked for
    root_path: str = ""
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_log_requests: bool = False
    max_log_len: int | None = None
    enable_log_outputs: bool = False
    uvicorn_log_level: str = "info"
    access_log: bool = True
    web_ui: bool = True

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HttpOptions:
        get = lambda name, default=None: getattr(args, name, default)  # noqa: E731 - other commands lack them
        opts = cls(ssl_keyfile=get("ssl_keyfile"), ssl_certfile=get("ssl_certfile"), ssl_ca_certs=get("ssl_ca_certs"),
                   ssl_cert_reqs=get("ssl_cert_reqs", 0), root_path=get("root_path") or "",
                   allowed_origins=tuple(list_option("--allowed-origins", get("allowed_origins"))),
                   allowed_methods=tuple(list_option("--allowed-methods", get("allowed_methods"))),
                   allowed_headers=tuple(list_option("--allowed-headers", get("allowed_headers"))),
                   allow_credentials=bool(get("allow_credentials", False)),
                   enable_log_requests=bool(get("enable_log_requests", False)), max_log_len=get("max_log_len"),
                   enable_log_outputs=bool(get("enable_log_outputs", False)),
                   uvicorn_log_level=get("uvicorn_log_level", "info"),
                   access_log=not get("disable_uvicorn_access_log", False),
                   web_ui=not get("disable_webui", False))
        opts.check()
        return opts

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    def check(self) -> None:
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile (the server's certificate)")
        if self.ssl_cert_reqs not in CERT_REQS:
            raise ValueError(f"--ssl-cert-reqs must be one of {list(CERT_REQS)} "
                             f"({', '.join(f'{k}: {v}' for k, v in CERT_REQS.items())}), got {self.ssl_cert_reqs!r}")
        if not self.tls and (self.ssl_ca_certs is not None or self.ssl_cert_reqs):
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need HTTPS: pass --ssl-certfile and --ssl-keyfile")
        if self.ssl_cert_reqs and self.ssl_ca_certs is None:
            raise ValueError(f"--ssl-cert-reqs {self.ssl_cert_reqs} checks client certificates: pass --ssl-ca-certs "
                             "with the CA certificates that signed them")
        check_tls_files(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs)
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"--root-path must start with '/' and not end with one, e.g. /llm, got {self.root_path!r}")
        if self.uvicorn_log_level not in UVICORN_LOG_LEVELS:
            raise ValueError(f"--uvicorn-log-level {self.uvicorn_log_level!r} is not valid; valid values: "
                             f"{list(UVICORN_LOG_LEVELS)}")
        if not self.enable_log_requests and (self.enable_log_outputs or self.max_log_len is not None):
            raise ValueError("--enable-log-outputs and --max-log-len shape the request log: pass --enable-log-requests")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be 0 or more (characters or token ids), got {self.max_log_len}")

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def request_logger(self) -> RequestLogger | None:
        return RequestLogger(self.max_log_len, self.enable_log_outputs) if self.enable_log_requests else None

    def app_kwargs(self) -> dict[str, Any]:
        """build_app's keyword arguments."""
        return dict(allowed_origins=list(self.allowed_origins), allowed_methods=list(self.allowed_methods),
                    allowed_headers=list(self.allowed_headers), allow_credentials=self.allow_credentials,
                    root_path=self.root_path, request_logger=self.request_logger(), web_ui=self.web_ui)

    def uvicorn_kwargs(self) -> dict[str, Any]:
        """create_server's keyword arguments (uvicorn.Config's names)."""
        kw: dict[str, Any] = dict(log_level=self.uvicorn_log_level, access_log=self.access_log)
        if self.tls:
            kw.update(ssl_certfile=self.ssl_certfile, ssl_keyfile=self.ssl_keyfile, ssl_ca_certs=self.ssl_ca_certs,
                      ssl_cert_reqs=self.ssl_cert_reqs)
        return kw


def check_port_free(host: str, port: int) -> None:
    """Raises ValueError, before anything loads, when the API server could not listen on host:port (uvicorn
    would find out only after the engine's warm-up). Binds as uvicorn does (SO_REUSEADDR, every address the
    host resolves to) and lets go at once."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve to an address to listen on ({e.strerror})") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(f"port {port} is in use: pass --port with a free one (make run: PORT=...), or "
                                     f"stop the server listening on {host}:{port}") from None
                raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}): pass another --host or --port") from None
