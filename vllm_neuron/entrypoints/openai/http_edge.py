"""The HTTP edge around the app: the API-key check, X-Request-Id, --root-path, an outermost guard for exceptions that
escape the app, uvicorn's own 400 answer as an OpenAI error object, and the heap given back after large requests.

Starlette's ServerErrorMiddleware answers an unexpected exception with our handler's 500 and then
re-raises it; uvicorn logs "Exception in ASGI application" and closes the connection, so a keep-alive
client loses its next request too. `ExceptionGuard` sits outside it: an exception after a complete
response is only logged, and one before any response gets the JSON 500 itself.

uvicorn answers a request it cannot parse (a bad Content-Length, a malformed request line, headers
larger than h11 takes) before any app runs, in plain text; `JsonErrorH11Protocol` writes the same 400
as the OpenAI error object. The connection is closed afterwards, as HTTP requires after a framing error.

A large request (a megabyte prompt, tokenized and answered 400) frees its memory into glibc's heaps,
which keep it: the process would stay hundreds of MB larger after one such request. `HeapTrim` calls
glibc's malloc_trim once a request with a large body has ended (at most once a second, off the event
loop), so those pages go back to the system.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import Callable

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from vllm_neuron import heap
from vllm_neuron.entrypoints.openai.errors import error_body, error_response
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

# Liveness probes and load balancers call these without credentials (vLLM's open routes that stay open
# with --api-key-all-routes).
LIVENESS_PATHS = frozenset({"/health", "/ping", "/version"})


def _app_path(scope: Scope) -> str:
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer KEY` on every /v1 route (vLLM's rule: /health, /ping, /metrics,
    /version, /tokenize, /detokenize and the docs stay open), or, with `all_routes`, on every route but
    the liveness probes' (`LIVENESS_PATHS`) and the paths `public` names (the web UI's pages, which hold no
    data: the API calls they make carry the key). Pure ASGI so streaming is untouched."""

    def __init__(self, app: ASGIApp, api_key: str, all_routes: bool = False,
                 public: Callable[[str], bool] | None = None) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._all_routes = all_routes
        self._public = public

    def _guarded(self, path: str) -> bool:
        if self._all_routes:
            return path not in LIVENESS_PATHS and not (self._public is not None and self._public(path))
        return path == "/v1" or path.startswith("/v1/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        if self._guarded(_app_path(scope)):
            given = b""
            for name, value in scope.get("headers", []):
                if name.lower() == b"authorization":
                    given = value
                    break
            if not hmac.compare_digest(given, self._expected):
                response = error_response("Unauthorized: a valid `Authorization: Bearer <api key>` header is "
                                          "required.", 401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


REQUEST_ID_HEADER = b"x-request-id"
MAX_REQUEST_ID_CHARS = 256


def header_request_id(scope: Scope) -> str | None:
    """The client's X-Request-Id (checked by RequestIdMiddleware), or None."""
    for name, value in scope.get("headers", []):
        if name.lower() == REQUEST_ID_HEADER:
            return value.decode("latin-1")
    return None


def use_request_id(scope: Scope, request_id: str) -> None:
    """Records the id a generation route gave its request: the X-Request-Id the response echoes."""
    scope.setdefault("state", {})["request_id"] = request_id


def _header_safe(value: str) -> bool:
    """A body's request_id may hold characters no header value may (control characters, non-Latin-1)."""
    return all(32 <= ord(c) < 256 and ord(c) != 127 for c in value)


class RequestIdMiddleware:
    """X-Request-Id as vLLM: a client's header names its request (the completion's id is built from it) and
    every response carries the header back: the id the route used, else the client's, else a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = header_request_id(scope)
        if given is not None and not 0 < len(given) <= MAX_REQUEST_ID_CHARS:
            response = error_response(f"The X-Request-Id header must have 1 to {MAX_REQUEST_ID_CHARS} characters, "
                                      f"got {len(given)}.", 400)
            await response(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # shared with the route's Request, even through scope copies

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                rid = next(r for r in (state.get("request_id"), given, uuid.uuid4().hex) if r and _header_safe(r))
                headers = [*message.get("headers", []), (REQUEST_ID_HEADER, rid.encode("latin-1"))]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class RootPath:
    """--root-path: the prefix a proxy serves the app under. The ASGI root_path of every request, so that routes
    match whether the proxy forwards `/prefix/v1/...` as it is or strips the prefix, and the docs link through it."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope["root_path"] = self.root_path
        await self.app(scope, receive, send)


class ExceptionGuard:
    """The outermost ASGI layer: no exception reaches uvicorn (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "complete": False}

        async def tracking_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["complete"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the app's own handlers have answered what they know
            if state["complete"]:
                return  # answered (ServerErrorMiddleware re-raises after its 500): keep the connection
            if state["started"]:
                raise  # half a response: only closing the connection can end it
            logger.exception("Unexpected error while serving a request")
            response = error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)
            await response(scope, receive, send)


class JsonErrorH11Protocol(H11Protocol):
    """uvicorn's h11 protocol whose parse-error 400 is an OpenAI error object (see the module docstring)."""

    def send_400_response(self, msg: str) -> None:
        # uvicorn's `msg` only says "Invalid HTTP request received."
        body = json.dumps(error_body("Invalid HTTP request: its request line, headers or Content-Length could not "
                                     "be parsed.", 400).model_dump()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(status_code=400, headers=headers,
                                                             reason=b"Bad Request")))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # a response was already under way: nothing more can be said
            pass
        self.transport.close()


class HeapTrim:
    """Gives the heap's free pages back to the system after requests whose body had `threshold_bytes` or
    more (see the module docstring)."""

    def __init__(self, app: ASGIApp, threshold_bytes: int = 1 << 20, min_interval_s: float = 1.0) -> None:
        self.app = app
        self.threshold_bytes = threshold_bytes
        self.min_interval_s = min_interval_s
        self._last = 0.0
        self._scheduled = False
        self.trims = 0  # how many trims ran

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not heap.available():
            await self.app(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counting_receive, send)
        finally:
            if received >= self.threshold_bytes:
                self._trim_soon()

    def _trim_soon(self) -> None:
        """One trim, as soon as the last one is `min_interval_s` old (requests ending together share it)."""
        if self._scheduled:
            return
        self._scheduled = True
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._last + self.min_interval_s - time.monotonic())
        loop.call_later(delay, lambda: loop.run_in_executor(None, self._run_trim))

    def _run_trim(self) -> None:
        try:
            heap.trim()
            self.trims += 1
        finally:
            self._last = time.monotonic()
            self._scheduled = False
