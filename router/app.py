"""The router's HTTP app: OpenAI + native routes, worker admin, health, metrics.

    POST /v1/completions, /v1/chat/completions, /generate   -> handlers.GenerationHandler
    GET  /v1/models, /health, /metrics, /workers (each worker's `source`: command-line, api, discovery)
    POST /workers {"url", "role", "bootstrap_port"?}  DELETE /workers?url=... (or {"url"})

`build_app(cfg)` wires one Router (all state) into a FastAPI app; every error
leaves through one exception boundary in the OpenAI shape. router/auth.py decides who
may call what (--api-key for clients, --admin-api-key for /workers) before a route runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.cluster_secret import load_router_keys
from common.server.generate_request import GenerateRequestBody
from common.server.generate_response import ErrorResponse, GenerateResponse
from common.server.openapi import ApiRoute, mount_openapi, openapi_document
from router.admission import Admission
from router.auth import AuthMiddleware
from router.config import RouterConfig, WorkerSpec, normalize_url
from router.discovery import ServiceDiscovery
from router.dispatcher import Dispatcher
from router.errors import ApiError, bad_request
from router.fields import decode_json_object, get_int, get_str
from router.handlers import GenerationHandler, json_response, read_body
from router.health import HealthChecker
from router.host_check import HostAllowlist
from router.kv_index import KVIndexes
from router.load import LoadMonitor
from router.metrics import RouterMetrics
from router.model_info import ModelInfo
from router.openai_request import RequestParser
from router.openai_types import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)
from router.registry import WorkerRegistry
from router.worker import Worker

logger = logging.getLogger("router")
_ROLE_ALIASES = {"prefill": "prefill", "decode": "decode", "worker": "colocated", "colocated": "colocated"}


class Router:
    """All router state; owned by the app, built before the event loop starts."""

    def __init__(self, cfg: RouterConfig, model: ModelInfo | None = None) -> None:
        self.cfg = cfg
        self.model = model or ModelInfo.load(cfg.model_path, cfg.served_model_name, cfg.context_length,
                                             cfg.max_prompt_chars)
        keys = load_router_keys(cfg.cluster_secret_file)
        self.kv_indexes = KVIndexes(keys.events if keys is not None else None)
        self.registry = WorkerRegistry(cfg, self.kv_indexes.cached_tokens)
        self.metrics = RouterMetrics(self.registry)
        signer = keys.signer() if keys is not None else None
        self.admission = Admission(cfg, self.registry, self.metrics)
        self.metrics.watch_admission(self.admission)
        self.dispatcher = Dispatcher(cfg, self.registry, self.metrics, self.admission, self.kv_indexes, signer)
        self.load = LoadMonitor(self.registry, cfg.load_report_interval, cfg.health_check_timeout,
                                self.admission.notify, signer)
        probe_ids = self.model.encode("ping")[:4]
        self.health = HealthChecker(cfg, self.registry, self.metrics, probe_ids, self.kv_indexes, signer)
        self.parser = RequestParser(self.model, cfg.default_max_tokens_cap, cfg.incremental_streaming_output,
                                    cfg.enable_priority_scheduling, max_chat_messages=cfg.max_chat_messages,
                                    max_prompt_logprob_entries=cfg.max_prompt_logprob_entries)
        self.handler = GenerationHandler(self)
        self.created = int(time.time())
        self.discovery = ServiceDiscovery.from_config(cfg, self) if cfg.service_discovery else None
        if self.discovery is not None:
            self.metrics.prom.register(self.discovery.collector())

    async def start(self) -> None:
        self.dispatcher.open()
        self.health.start()
        if self.cfg.load_report_interval > 0:
            self.load.start()
        if self.discovery is not None:
            self.discovery.start()

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.load.stop()
        await self.health.stop()
        await self.dispatcher.close()
        await self.kv_indexes.close()
        self.handler.close()

    async def add_worker(self, spec: WorkerSpec) -> Worker:
        """The one registration path (POST /workers, service discovery): register, then verify."""
        w = self.register(spec)
        await self.verify_worker(w)
        return w

    def register(self, spec: WorkerSpec) -> Worker:
        """In the registry now, not routable before verify_worker's probe (ApiError 409 on a known URL)."""
        return self.registry.add(spec)

    async def verify_worker(self, w: Worker) -> None:
        """Probe a newly registered worker at once (it is routable after its first good probe), and
        a prefill->decode round trip if none has succeeded yet."""
        await self.health.check_worker(w)
        if self.cfg.disaggregated and not self.health.pd_verified and not w.removed:
            await self.health.probe_pair()
        logger.info("worker %s (%s, %s) added, healthy=%s%s", w.url, w.role, w.source, w.health.healthy,
                    "" if w.health.healthy else f" ({w.health.last_error})")

    def remove_worker(self, url: str) -> Worker:
        """Never picked again; requests it already has finish (DELETE /workers, discovery)."""
        w = self.registry.remove(url)
        logger.info("worker %s (%s, %s) removed", w.url, w.role, w.source)
        return w

    def not_ready_reason(self) -> str | None:
        """Public text (unauthenticated /health): roles only; URLs and error text are on /workers and the log."""
        for role in self.registry.roles:
            if not self.registry.available(role):
                return f"{role} unavailable"
        if not self.health.pd_verified:
            return "no prefill->decode round trip has succeeded yet"
        return None


def build_app(cfg: RouterConfig, model: ModelInfo | None = None) -> FastAPI:
    router = Router(cfg, model)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    h = router.handler

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return json_response(exc.encode(), exc.status, request.headers.get("x-request-id"), exc.retry_after)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        err = ApiError(exc.status_code, str(exc.detail), code=exc.status_code,
                       type="not_found_error" if exc.status_code == 404 else "invalid_request_error")
        return json_response(err.encode(), exc.status_code, None)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        err = ApiError(500, "router internal error (details are in the router's log)", type="internal_error")
        return json_response(err.encode(), 500, None)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await h.handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await h.handle(request, "chat")

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        return await h.handle(request, "generate")

    @app.get("/v1/models")
    async def models() -> Response:
        m = router.model
        card = {"id": m.name, "object": "model", "created": router.created, "owned_by": "pdserve", "root": m.name,
                "max_model_len": m.context_length}
        return json_response(msgspec.json.encode({"object": "list", "data": [card]}), 200, None)

    @app.get("/health")
    async def health() -> Response:
        reason = router.not_ready_reason()
        if reason is not None:
            err = ApiError(503, f"router not ready: {reason}", type="service_unavailable", code="not_ready")
            return json_response(err.encode(), 503, None)
        return json_response(b'{"status":"ready"}', 200, None)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/workers")
    async def list_workers() -> Response:
        workers = [{**w.describe(), "kv_index": router.kv_indexes.describe(w.url)} for w in router.registry.all()]
        body = {"mode": "disaggregated" if cfg.disaggregated else "colocated", "ready": router.health.ready,
                "pd_verified": router.health.pd_verified, "last_probe_error": router.health.last_probe_error,
                "workers": workers,
                "service_discovery": router.discovery.describe() if router.discovery is not None else None}
        return json_response(msgspec.json.encode(body), 200, None)

    @app.post("/workers")
    async def add_worker(request: Request) -> Response:
        body = decode_json_object(await read_body(request, 1 << 16), request.headers.get("content-type"))
        spec = _worker_spec(body)
        w = await router.add_worker(spec)
        # One answer whatever the probe met (refused, timeout, another service): POST /workers
        # must not tell a caller which host:port is open. The reason is in the log.
        port = w.bootstrap_port if w.health.healthy else spec.bootstrap_port
        added = {"url": w.url, "role": w.role, "bootstrap_port": port, "healthy": w.health.healthy,
                 "message": "added" if w.health.healthy else
                 "added; not healthy yet (the router keeps probing it; the reason is in the router's log)"}
        return json_response(msgspec.json.encode(added), 200, None)

    @app.delete("/workers")
    async def remove_worker(request: Request) -> Response:
        url = request.query_params.get("url")
        if url is None:
            body = decode_json_object(await read_body(request, 1 << 16), request.headers.get("content-type"))
            url = get_str(body, "url")
        if not url:
            raise bad_request("'url' is required (query parameter or JSON body)", "url")
        w = router.remove_worker(_url(url))
        return json_response(msgspec.json.encode(w.describe()), 200, None)

    mount_openapi(app, openapi_document("pdserve router", ROUTER_ROUTES), docs=cfg.enable_docs)
    hosts = HostAllowlist(cfg.host, cfg.api_key is not None, cfg.allowed_hosts)
    app.add_middleware(AuthMiddleware, api_key=cfg.api_key, admin_api_key=cfg.admin_api_key, hosts=hosts)
    return app


ROUTER_ROUTES = [
    ApiRoute("POST", "/v1/completions", "OpenAI completions (echo + logprobs: prompt logprobs)", CompletionRequest,
             {"200": CompletionResponse, "404": ErrorResponse}, streams=True),
    ApiRoute("POST", "/v1/chat/completions", "OpenAI chat completions", ChatCompletionRequest,
             {"200": ChatCompletionResponse, "404": ErrorResponse}, streams=True),
    ApiRoute("POST", "/generate", "SGLang-native generation (docs/generate_api.md)", GenerateRequestBody,
             {"200": GenerateResponse}, streams=True),
    ApiRoute("GET", "/v1/models", "the served model", None, {"200": ModelList}, errors=False),
    ApiRoute("GET", "/health", "200 once a prefill->decode round trip succeeded", None,
             {"200": dict[str, str]}),
    ApiRoute("GET", "/metrics", "Prometheus text", None, {"200": None}, media_type="text/plain", errors=False),
]


def _url(raw: str) -> str:
    try:
        return normalize_url(raw)
    except ValueError as e:
        raise bad_request(str(e), "url") from None


def _worker_spec(body: dict[str, Any]) -> WorkerSpec:
    url = get_str(body, "url")
    if not url:
        raise bad_request("'url' is required", "url")
    role = _ROLE_ALIASES.get(get_str(body, "role") or "")
    if role is None:
        raise bad_request("'role' must be one of prefill, decode, worker", "role")
    port = get_int(body, "bootstrap_port", None, lo=1, hi=65535)
    if port is not None and role != "prefill":
        raise bad_request("'bootstrap_port' applies to prefill workers only", "bootstrap_port")
    return WorkerSpec(_url(url), role, port, source="api")  # type: ignore[arg-type]
