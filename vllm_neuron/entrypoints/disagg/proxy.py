"""`vllm-neuron disagg-proxy`: one OpenAI-compatible endpoint in front of prefill and decode instances
(vLLM's disaggregation protocol, the one its NixlConnector's toy proxy speaks).

A request goes first to a prefill instance, as a copy with `max_tokens: 1`, `stream: false` and
`kv_transfer_params: {"do_remote_decode": true, ...}`; the prefill instance answers with the
`kv_transfer_params` that say where the prompt's KV blocks are held. The original request, with those params,
then goes to a decode instance, which reads the blocks, prefills only the last prompt token, and answers
(streaming or not) straight through the proxy. Each kind is chosen by least outstanding requests (pool.py).

Failures: a prefill instance that is unreachable or answers 5xx is skipped for the next one (and for a few
seconds after); with none left the request goes to a decode instance without params, which prefills it
itself. A decode instance that cannot read the blocks prefills locally (its own metric counts that). A 4xx
from an instance is the request's fault and is returned as is. The proxy keeps no state of the servers: killing
it loses nothing there (a prefill instance frees unread blocks after its hold timeout).
"""
from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from vllm_neuron.entrypoints.disagg.pool import Instance, InstancePool
from vllm_neuron.logger import init_logger

logger = init_logger(__name__)

_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                   "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(body: dict) -> dict:
    """The prefill instance's copy of a request (pure): one token, not streamed, asking for held KV."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(_PREFILL_PARAMS))
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["kind", "url"]
        self.outstanding = Gauge("vllm_neuron_proxy:outstanding_requests", "Requests in flight, per instance.",
                                 labels, registry=self.registry)
        self.requests = Counter("vllm_neuron_proxy:requests", "Requests sent, per instance.", labels,
                                registry=self.registry)
        self.failures = Counter("vllm_neuron_proxy:failures", "Requests an instance failed (unreachable or 5xx), "
                                "per instance.", labels, registry=self.registry)
        self.local_prefills = Counter("vllm_neuron_proxy:prefill_fallbacks", "Requests sent to a decode instance "
                                      "without KV because no prefill instance answered.", registry=self.registry)


class DisaggProxy:
    def __init__(self, prefill: list[str], decode: list[str], *, timeout_s: float = 600.0,
                 backoff_s: float = 5.0) -> None:
        self.prefill = InstancePool("prefill", prefill, backoff_s=backoff_s)
        self.decode = InstancePool("decode", decode, backoff_s=backoff_s)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.metrics = _Metrics()
        for pool in (self.prefill, self.decode):
            for inst in pool.instances:
                self.metrics.outstanding.labels(pool.kind, inst.url).set(0)

    def _start(self, pool: InstancePool, inst: Instance) -> None:
        pool.start(inst)
        self.metrics.requests.labels(pool.kind, inst.url).inc()
        self.metrics.outstanding.labels(pool.kind, inst.url).set(inst.outstanding)

    def _finish(self, pool: InstancePool, inst: Instance, ok: bool) -> None:
        pool.finish(inst, ok)
        if not ok:
            self.metrics.failures.labels(pool.kind, inst.url).inc()
        self.metrics.outstanding.labels(pool.kind, inst.url).set(inst.outstanding)

    async def _prefill(self, path: str, body: dict, headers: dict) -> tuple[dict | None, Response | None]:
        """(kv_transfer_params, None), or (None, the instance's 4xx to return), or (None, None): none answered."""
        for inst in self.prefill.order():
            self._start(self.prefill, inst)
            ok = False
            try:
                r = await self.client.post(inst.url + path, json=prefill_body(body), headers=headers)
                if r.status_code >= 500:
                    logger.warning("prefill instance %s answered %d; trying the next", inst.url, r.status_code)
                    continue
                ok = True
                if r.status_code >= 400:
                    return None, Response(r.content, r.status_code, media_type="application/json")
                params = r.json().get("kv_transfer_params")
                if not params:
                    logger.warning("prefill instance %s sent no kv_transfer_params (is it started with "
                                   "--kv-transfer-config?); the decode instance prefills this request", inst.url)
                return params, None
            except (httpx.HTTPError, ValueError) as e:
                logger.warning("prefill instance %s failed (%s: %s); trying the next", inst.url, type(e).__name__, e)
            finally:
                self._finish(self.prefill, inst, ok)
        self.metrics.local_prefills.inc()
        return None, None

    async def handle(self, path: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
            if not isinstance(body, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as e:
            return JSONResponse({"error": {"message": f"invalid JSON body: {e}", "type": "BadRequestError",
                                           "param": None, "code": 400}}, 400)
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        params, error = await self._prefill(path, body, headers)
        if error is not None:
            return error
        body = {**body, "kv_transfer_params": params} if params else {k: v for k, v in body.items()
                                                                       if k != "kv_transfer_params"}
        return await self._decode(path, body, headers)

    async def _decode(self, path: str, body: dict, headers: dict) -> Response:
        last_error = "no decode instance"
        for inst in self.decode.order():
            self._start(self.decode, inst)
            try:
                req = self.client.build_request("POST", inst.url + path, json=body, headers=headers)
                r = await self.client.send(req, stream=True)
            except httpx.HTTPError as e:
                self._finish(self.decode, inst, False)
                last_error = f"{inst.url}: {type(e).__name__}: {e}"
                logger.warning("decode instance %s failed (%s); trying the next", inst.url, last_error)
                continue
            if r.status_code >= 500 and len(self.decode.instances) > 1:
                await r.aclose()
                self._finish(self.decode, inst, False)
                last_error = f"{inst.url} answered {r.status_code}"
                continue
            return StreamingResponse(self._relay(inst, r), status_code=r.status_code,
                                     media_type=r.headers.get("content-type"), headers={"X-Request-Id": headers["X-Request-Id"]})
        return JSONResponse({"error": {"message": f"no decode instance could serve the request ({last_error})",
                                       "type": "ServiceUnavailableError", "param": None, "code": 503}}, 503)

    async def _relay(self, inst: Instance, r: httpx.Response) -> AsyncIterator[bytes]:
        ok = False
        try:
            async for chunk in r.aiter_raw():
                yield chunk
            ok = r.status_code < 500
        finally:
            await r.aclose()
            self._finish(self.decode, inst, ok)

    async def health(self) -> Response:
        up = {"prefill": [i.url for i in self.prefill.healthy()], "decode": [i.url for i in self.decode.healthy()]}
        return JSONResponse(up, 200 if up["decode"] else 503)

    async def models(self) -> Response:
        for inst in self.decode.order():
            try:
                r = await self.client.get(inst.url + "/v1/models")
                return Response(r.content, r.status_code, media_type="application/json")
            except httpx.HTTPError:
                continue
        return JSONResponse({"error": {"message": "no decode instance answered", "type": "ServiceUnavailableError",
                                       "param": None, "code": 503}}, 503)


def build_app(proxy: DisaggProxy, title: str = "vllm-neuron disagg-proxy") -> FastAPI:
    """The proxy's routes (the EPD proxy, a DisaggProxy too, serves the same ones)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        await proxy.client.aclose()

    app = FastAPI(title=title, lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models() -> Response:
        return await proxy.models()

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), media_type="text/plain; version=0.0.4")

    return app


def run_proxy(args) -> int:
    import uvicorn

    proxy = DisaggProxy(args.prefill, args.decode, timeout_s=args.timeout)
    logger.info("disagg-proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port,
                ", ".join(i.url for i in proxy.prefill.instances), ", ".join(i.url for i in proxy.decode.instances))
    uvicorn.run(build_app(proxy), host=args.host, port=args.port, log_level="info")
    return 0
