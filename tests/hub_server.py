"""A local Hugging Face hub for the download tests: the routes huggingface_hub calls, in the hub's URL layout,
over real HTTP on 127.0.0.1 (point HF_ENDPOINT at `LocalHub.url`). No mock of the client: the tests run the
real huggingface_hub against it.

    /api/models/{org}/{name}/revision/{rev}      repository info (sha, siblings)
    /api/models/{org}/{name}/tree/{rev}[/{path}] file listing
    /{org}/{name}/resolve/{rev}/{path}           file bytes (HEAD: size, ETag, X-Repo-Commit), Range requests

Errors are the hub's: 404 with X-Error-Code RepoNotFound / RevisionNotFound / EntryNotFound, and 401 RepoNotFound
for a private repository without the right token. `stall(path, after)` makes the downloads of `path` stop after
`after` bytes and hang until `release()` (a client killed in the middle); with `hang=False` the next download of
`path` is cut there, its connection closed (a dropped connection).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

TOKEN = "hf_local_test_token"
_REPO = r"(?P<repo>[^/]+/[^/]+)"
_ROUTES = [
    ("info", re.compile(rf"^/api/models/{_REPO}/revision/(?P<rev>[^/]+)$")),
    ("tree", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")),
    ("file", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
]


@dataclass
class Repo:
    revisions: dict[str, dict[str, bytes]]  # branch / tag -> {path: content}
    private: bool = False
    commits: dict[str, str] = field(default_factory=dict)  # branch / tag -> commit sha

    def __post_init__(self) -> None:
        for name, files in self.revisions.items():
            digest = hashlib.sha1(json.dumps(sorted((p, hashlib.sha1(b).hexdigest()) for p, b in files.items()))
                                  .encode() + name.encode())
            self.commits[name] = digest.hexdigest()

    def resolve(self, rev: str) -> tuple[str, dict[str, bytes]] | None:
        for name, sha in self.commits.items():
            if rev in (name, sha):
                return sha, self.revisions[name]
        return None


def folder_files(folder: str) -> dict[str, bytes]:
    """Every file under `folder` by its relative path (a model directory as a repository's content)."""
    out = {}
    for root, _, names in os.walk(folder):
        for n in names:
            full = os.path.join(root, n)
            with open(full, "rb") as f:
                out[os.path.relpath(full, folder).replace(os.sep, "/")] = f.read()
    return out


class LocalHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self._stall: tuple[str, int, bool] | None = None
        self.stalled = threading.Event()  # set when a stalled download has sent its bytes
        self._release = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def add(self, repo_id: str, revisions: dict[str, dict[str, bytes]], private: bool = False) -> Repo:
        self.repos[repo_id] = Repo(revisions, private)
        return self.repos[repo_id]

    def stall(self, path: str, after: int, hang: bool = True) -> None:
        self._stall = (path, after, hang)
        self.stalled.clear()
        self._release.clear()

    def release(self) -> None:
        self._stall = None
        self._release.set()

    def downloads(self, path_suffix: str) -> list[str | None]:
        """The Range header of every GET of a file whose path ends with `path_suffix`."""
        return [rng for method, p, rng in self.requests if method == "GET" and "/resolve/" in p
                and p.endswith(path_suffix)]

    def close(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _error(self, status: int, code: str, message: str) -> None:
                payload = json.dumps({"error": message}).encode()
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _json(self, data) -> None:
                payload = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _serve(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                kind, m = next(((k, rx.match(path)) for k, rx in _ROUTES if rx.match(path)), (None, None))
                if m is None:
                    return self._error(404, "EntryNotFound", f"no route {path}")
                repo = hub.repos.get(m["repo"])
                if repo is None:
                    return self._error(404, "RepoNotFound", "Repository not found")
                if repo.private and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._error(401, "RepoNotFound", "Invalid username or password.")
                resolved = repo.resolve(m["rev"])
                if resolved is None:
                    return self._error(404, "RevisionNotFound", f"Invalid rev id: {m['rev']}")
                sha, files = resolved
                if kind == "info":
                    return self._json({"id": m["repo"], "sha": sha, "private": repo.private,
                                       "siblings": [{"rfilename": p} for p in sorted(files)]})
                if kind == "tree":
                    prefix = (m["path"] or "").strip("/")
                    return self._json([{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                       for p, b in sorted(files.items()) if p.startswith(prefix)])
                content = files.get(m["path"])
                if content is None:
                    return self._error(404, "EntryNotFound", f"{m['path']} does not exist")
                self._file(m["path"], content, sha, body)

            def _file(self, name: str, content: bytes, sha: str, body: bool) -> None:
                start = 0
                rng = self.headers.get("Range")
                if rng and body:
                    start = int(re.match(r"bytes=(\d+)-", rng).group(1))
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", sha)
                self.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(content) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(content) - 1}/{len(content)}")
                self.end_headers()
                if not body:
                    return
                stall = hub._stall
                if stall is not None and name == stall[0]:
                    self.wfile.write(content[start:stall[1]])
                    self.wfile.flush()
                    hub.stalled.set()
                    if stall[2]:
                        hub._release.wait(60)
                    else:
                        hub._stall = None  # once
                    self.close_connection = True
                    return
                self.wfile.write(content[start:])

        return Handler
