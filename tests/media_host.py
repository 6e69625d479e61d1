"""A local HTTP server playing a media host in a thread: GET /to/<url> redirects to <url> (PORT in it is
replaced by the server's port), /slow answers after 3 s, /big sends 5000 bytes, anything else `body`.
`requests` lists the paths asked for, `hosts` their Host headers."""
from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class MediaHost:
    def __init__(self, body: bytes) -> None:
        self.body = body
        self.requests: list[str] = []
        self.hosts: list[str | None] = []
        self.port = 0


@contextmanager
def media_host(body: bytes) -> Iterator[MediaHost]:
    host = MediaHost(body)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            host.requests.append(self.path)
            host.hosts.append(self.headers.get("Host"))
            if self.path.startswith("/to/"):
                self.send_response(302)
                self.send_header("Location", self.path[len("/to/"):].replace("PORT", str(host.port)))
                self.end_headers()
                return
            if self.path == "/slow":
                time.sleep(3)
            body = b"x" * 5000 if self.path == "/big" else host.body
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    host.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield host
    finally:
        server.shutdown()
        server.server_close()
