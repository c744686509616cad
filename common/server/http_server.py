"""The instance's HTTP app: /generate, /health, /health_generate, /server_info, /metrics, /get_load,
/abort_request.

/health is liveness: answered from the engine's step clock and the last known engine
answer (common/server/liveness.py), in milliseconds, never waiting for a step; 200 while
the engine process lives and is idle or in a step younger than --watchdog-timeout.
/health_generate is SGLang's deep check (not what the router probes): a one-token
generate on a colocated instance; on prefill or decode, which need a peer to generate,
a stats round trip through the engine loop (answered between steps).

One exception boundary: every failure leaves as the error shape of
docs/generate_api.md ({"error": {"message", "type", "code"}}), including
FastAPI's own 404/405 and unexpected exceptions (500). A streaming response
whose headers are already out reports a failure as one `data: {"error": ...}`
event followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from common.sampling_request import SamplingParamsRequest
from common.secret_file import resolve_secret
from common.server.generate_response import (
    AbortResponse,
    ErrorResponse,
    GenerateResponse,
    HealthResponse,
    LoadReport,
)
from common.server.metrics_token import MetricsToken
from common.server.openapi import ApiRoute, mount_openapi, openapi_document
from common.server.protocol import (
    MAX_BODY_BYTES,
    AbortRequestBody,
    ApiError,
    GenerateRequestBody,
    decode_abort_body,
    decode_generate_body,
    error_body,
)
from common.server.req_state import CumulativeStream, ReqState
from common.server.stream_cutoff import CutOffStreamingResponse
from common.server.tokenizer_manager import TokenizerManager
from common.timeouts import wait_within

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.1
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's default for /health_generate
METRICS_STATS_TIMEOUT_S = 1.0
METRICS_MAX_AGE_S = 1.0  # a scrape may get stats this old if no step ran and no request moved since
METRICS_TOKEN_ENV = "PDSERVE_METRICS_TOKEN"
CLIENT_CLOSED_STATUS = 499
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _json(status: int, content: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(content), status_code=status, media_type="application/json", headers=headers)


def _error(exc: ApiError) -> Response:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after is not None else None
    return _json(exc.status, exc.body(), headers)


def _sse(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


async def read_json_body(request: Request) -> bytes:
    """The raw body, after content-type and size checks (415 / 413)."""
    ctype = request.headers.get("content-type") or ""
    mime = ctype.split(";", 1)[0].strip().lower()
    if mime != "application/json" and not mime.endswith("+json"):  # a missing type too: see router/fields.py
        raise ApiError(415, f"Content-Type must be application/json, got {ctype[:100]!r}")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
    body = bytearray()
    try:
        async for part in request.stream():  # the answer closes the connection (conn_limits.CloseOnReject)
            body += part
            if len(body) > MAX_BODY_BYTES:
                raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:  # gone, or closed by conn_limits (body deadline, rate, budget)
        raise ApiError(400, "the client closed the connection before its body was complete") from None
    return bytes(body)


def create_app(manager: TokenizerManager, server_info: dict[str, Any]) -> FastAPI:
    app = FastAPI(title="pdserve instance", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = manager.metrics

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return _json(exc.status_code, error_body(exc.status_code, str(exc.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        return _json(400, error_body(400, f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        rid = request.headers.get("x-request-id", "")[:128]
        logger.exception("unhandled error on %s (X-Request-Id %r)", request.url.path, rid)
        return _json(500, error_body(500, "internal error (details are in the instance's log)"))

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            body = decode_generate_body(await read_json_body(request))
            rid = body.rid or request.headers.get("x-request-id") or uuid.uuid4().hex
            state = await manager.start(body, rid)
        except ApiError as e:
            metrics.requests.labels(status=str(e.status)).inc()
            raise
        if body.stream:
            return CutOffStreamingResponse(
                _sse_events(manager, state),
                state.cut_off,
                media_type="text/event-stream",
                headers=SSE_HEADERS,
                background=BackgroundTask(manager.release, state),
            )
        return await _collect_unless_disconnected(manager, state, request)

    @app.get("/health")
    async def health() -> Response:
        snap = manager.health()
        return _json(200, {"status": "ok", "engine": snap.describe(time.monotonic())})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        manager.health()
        if manager.args.disaggregation_mode == "null":
            await _one_token_generate(manager, HEALTH_GENERATE_TIMEOUT_S)
            return _json(200, {"status": "ok", "check": "generate"})
        await manager.get_stats(timeout_s=HEALTH_GENERATE_TIMEOUT_S)
        return _json(200, {"status": "ok", "check": "engine_round_trip"})

    @app.get("/server_info")
    async def info() -> Response:
        return _json(200, {**server_info, "engine_alive": manager.engine_dead is None})

    metrics_auth = MetricsToken(resolve_secret("--metrics-token", manager.args.metrics_token,
                                               manager.args.metrics_token_file, METRICS_TOKEN_ENV))

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        metrics_auth.check(request.headers.get("authorization"))
        try:
            await manager.get_stats(timeout_s=METRICS_STATS_TIMEOUT_S, max_age_s=METRICS_MAX_AGE_S)
        except ApiError:
            pass  # serve the last known engine stats, with pdserve_engine_up 0
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/get_load")
    async def get_load() -> Response:
        stats = await manager.get_stats(timeout_s=METRICS_STATS_TIMEOUT_S)
        return _json(200, LoadReport.from_stats(stats))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        rid = decode_abort_body(await read_json_body(request)).rid
        if not manager.abort(rid):
            raise ApiError(404, f"no request with rid {rid!r} is in flight")
        return _json(200, {"rid": rid, "aborted": True})

    mount_openapi(app, openapi_document("pdserve instance", INSTANCE_ROUTES))
    return app


INSTANCE_ROUTES = [
    ApiRoute("POST", "/generate", "SGLang-native generation (docs/generate_api.md)", GenerateRequestBody,
             {"200": GenerateResponse}, streams=True),
    ApiRoute("GET", "/health", "liveness from the engine's step clock", None, {"200": HealthResponse}),
    ApiRoute("GET", "/health_generate", "deep check through the engine", None, {"200": HealthResponse}),
    ApiRoute("GET", "/server_info", "what the engine built", None, {"200": dict[str, Any]}, errors=False),
    ApiRoute("GET", "/metrics", "Prometheus text", None, {"200": None}, media_type="text/plain", errors=False),
    ApiRoute("GET", "/get_load", "load report for the router (SGLang's name)", None, {"200": LoadReport}),
    ApiRoute("POST", "/abort_request", "abort an in-flight request", AbortRequestBody,
             {"200": AbortResponse, "404": ErrorResponse}),
]


async def _one_token_generate(manager: TokenizerManager, timeout_s: float) -> None:
    body = GenerateRequestBody(input_ids=[0], sampling_params=SamplingParamsRequest(max_new_tokens=1, temperature=0.0))
    state = await manager.start(body, "health_generate-" + uuid.uuid4().hex)
    try:
        await wait_within(manager.collect(state), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(503, f"the engine did not generate a token within {timeout_s:g}s") from None
    finally:
        manager.release(state)


async def _sse_events(manager: TokenizerManager, state: ReqState) -> AsyncIterator[bytes]:
    status = 200
    cumulative = None if state.incremental else CumulativeStream()
    try:
        async for chunk in manager.stream(state):
            yield _sse((chunk if cumulative is None else cumulative.add(chunk)).to_json())
    except ApiError as e:
        status = e.status
        yield _sse(e.body())
    except asyncio.CancelledError:
        status = CLIENT_CLOSED_STATUS
        raise
    finally:
        manager.metrics.requests.labels(status=str(status)).inc()
    yield b"data: [DONE]\n\n"


async def _collect_unless_disconnected(
    manager: TokenizerManager, state: ReqState, request: Request
) -> Response:
    """Run the request to its end, but abort it as soon as the client hangs up."""
    collect = asyncio.ensure_future(manager.collect(state))
    try:
        while not collect.done():
            await asyncio.wait({collect}, timeout=DISCONNECT_POLL_S)
            if not collect.done() and await request.is_disconnected():
                collect.cancel()
                manager.release(state)
                manager.metrics.requests.labels(status=str(CLIENT_CLOSED_STATUS)).inc()
                return Response(status_code=CLIENT_CLOSED_STATUS)
        try:
            result = collect.result()
        except ApiError as e:
            manager.metrics.requests.labels(status=str(e.status)).inc()
            return _error(e)
        manager.metrics.requests.labels(status="200").inc()
        return _json(200, result.to_json())
    finally:
        if not collect.done():
            collect.cancel()
        manager.release(state)
