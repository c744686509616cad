"""The generation routes' hot path: read, validate, dispatch, answer.

    body -> RequestParser (400s here, nothing sent) -> Dispatcher.start
         -> wait for the first worker event (or the client leaving)
            error before it      -> HTTP error (OpenAI shape), never an empty 200
            non-streaming        -> one JSON body
            streaming            -> SSE: first event, the rest, usage chunk, [DONE];
                                    a failure after that is an in-band error event
         -> client disconnect at any point cancels the run (both upstreams close)

Request ids: the router makes its own for every request (what workers see), so a client
reusing an id cannot collide with another user's request on a worker. The client's
X-Request-Id (or /generate "rid") is only a label: echoed in the X-Request-Id header, the
response ids and the log. Bodies over OFFLOAD_BYTES are decoded, checked and tokenized
in a thread, so a huge prompt never stalls the event loop (/health, other streams).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

import router.grammar_check as grammar_check
from common.server.stream_cutoff import CutOffStreamingResponse
from router.errors import ApiError, UpstreamError
from router.fields import check_json_content_type, decode_json_object
from router.native_response import CumulativeEvents, prompt_only, sse_event
from router.openai_request import safe_rid
from router.openai_response import SSE_DONE, ResponseFormatter, sse
from router.pair_choice import session_key
from router.plan import Api, GenerationPlan
from router.upstream import WorkerEvent

if TYPE_CHECKING:
    from router.app import Router
    from router.dispatcher import RequestRun

logger = logging.getLogger("router.request")
T = TypeVar("T")
_ENC = msgspec.json.Encoder()
ROUTES: dict[Api, str] = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/generate"}
OFFLOAD_BYTES = 32 << 10  # bodies above this are parsed (JSON, template, tokenizer) off the event loop
OFFLOAD_PROMPT_LOGPROBS = 4096  # first events with more prompt logprob entries are formatted off the loop


class ClientGone(Exception):
    pass


def json_response(body: bytes, status: int, rid: str | None, retry_after: int | None = None) -> Response:
    headers = {"X-Request-Id": rid} if rid else {}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return Response(body, status_code=status, media_type="application/json", headers=headers or None)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes; the limit is {limit}", code="payload_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="payload_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or closed by conn_limits (body deadline, rate, budget): nobody to answer
        raise ApiError(400, "the client closed the connection before its body was complete") from None
    return b"".join(chunks)


async def _unless_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw`, or raise ClientGone if the client disconnects first (body already read)."""
    main = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((main, watch), return_when=asyncio.FIRST_COMPLETED)
        if main.done():
            return main.result()
        raise ClientGone
    finally:
        watch.cancel()
        if not main.done():
            main.cancel()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (uvicorn may hand out empty body events first)."""
    receive = request.receive
    while (await receive())["type"] != "http.disconnect":
        pass


async def _off_loop_if_big(plan: GenerationPlan, fn: Callable[[], bytes]) -> bytes:
    """fn() in a thread when it formats many prompt logprobs (a dict and a token text each), so
    one echo request does not stall every other client; else inline."""
    if plan.prompt_logprob_start < 0:
        return fn()
    entries = (len(plan.input_ids) - plan.prompt_logprob_start) * max(1, plan.top_logprobs_num)
    return await asyncio.to_thread(fn) if entries > OFFLOAD_PROMPT_LOGPROBS else fn()


def _relabel(ev: WorkerEvent, label: str) -> WorkerEvent:
    """A native event with the client's label as meta_info.id (workers saw the router's id)."""
    meta = ev.data.get("meta_info")
    if not isinstance(meta, dict) or "id" not in meta:
        return ev
    data = {**ev.data, "meta_info": {**meta, "id": label}}
    return WorkerEvent(_ENC.encode(data), data)


class GenerationHandler:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.parser = router.parser
        self.metrics = router.metrics
        self.max_body = router.cfg.max_body_bytes
        self._parse_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="router-parse")
        self.grammar_check = grammar_check.GrammarChecker()

    def close(self) -> None:
        self._parse_pool.shutdown(wait=False, cancel_futures=True)
        self.grammar_check.close()

    def _parse(self, raw: bytes, content_type: str | None, api: Api, session_header: str | None) -> GenerationPlan:
        body = decode_json_object(raw, content_type)
        if api == "completion":
            plan = self.parser.completion(body)
        elif api == "chat":
            plan = self.parser.chat(body)
        else:
            plan = self.parser.generate(body)
        session = session_header or body.get("user")
        if session:
            plan = dataclasses.replace(plan, session_id=session_key(session))
        return plan

    async def handle(self, request: Request, api: Api) -> Response:
        t0 = time.perf_counter()
        route = ROUTES[api]
        rid = uuid.uuid4().hex
        label = request.headers.get("x-request-id")
        if label is not None and not safe_rid(label):
            label = None
        try:
            self.router.admission.check_full()
            ctype = request.headers.get("content-type")
            check_json_content_type(ctype)  # 415 before reading a body (the connection then closes)
            raw = await read_body(request, self.max_body)
            session = request.headers.get("x-session-id")
            if len(raw) > OFFLOAD_BYTES:
                with self.router.admission.parsing():
                    loop = asyncio.get_running_loop()
                    plan = await loop.run_in_executor(self._parse_pool, self._parse, raw, ctype, api, session)
            else:
                plan = self._parse(raw, ctype, api, session)
        except ApiError as e:
            return self._error(route, e, rid, label)
        try:
            await self.grammar_check.check(plan)  # a bad schema / regex / grammar: 400 before any worker
        except ApiError as e:
            return self._error(route, e, rid, label)
        label = label or plan.client_rid or rid
        run = self.router.dispatcher.start(plan, rid)
        if label != rid:
            logger.debug("rid=%s label=%s", rid, label)
        try:
            first = await _unless_disconnected(request, run.first())
        except ApiError as e:
            return self._error(route, e, rid, label)
        except ClientGone:
            run.cancel()
            self.metrics.requests.labels(route, "499").inc()
            return Response(status_code=499)
        except BaseException:
            run.cancel()
            raise
        relabel = api == "generate" and label != rid
        if relabel:
            first = _relabel(first, label)
        if not plan.stream:
            self._done(route, "200", t0)
            if api == "generate":
                out = _ENC.encode(prompt_only(first.data)) if plan.prompt_only else first.raw
                return json_response(out, 200, label)
            fmt = ResponseFormatter(plan, label, self.router.model)
            return json_response(await _off_loop_if_big(plan, lambda: fmt.full(first.data)), 200, label)
        self.metrics.ttft.labels(route).observe(time.perf_counter() - t0)
        return CutOffStreamingResponse(
            self._stream(plan, rid, label, relabel, run, first, route, t0), run.cut_off,
            media_type="text/event-stream", headers={"X-Request-Id": label, "Cache-Control": "no-cache"})

    async def _stream(self, plan: GenerationPlan, rid: str, label: str, relabel: bool, run: RequestRun,
                      first: WorkerEvent, route: str, t0: float) -> AsyncIterator[bytes]:
        native = plan.api == "generate"
        fmt = None if native else ResponseFormatter(plan, label, self.router.model)
        cumulative = CumulativeEvents() if native and not plan.incremental else None
        itl = self.metrics.itl.labels(route)
        status = "client_gone"
        last = time.perf_counter()
        try:
            if fmt is not None:
                yield await _off_loop_if_big(plan, lambda: fmt.chunk(first.data))
            elif plan.prompt_only:
                yield await _off_loop_if_big(plan, lambda: sse_event(prompt_only(first.data)))
            elif cumulative is not None:
                cumulative.add(first.data)
                yield await _off_loop_if_big(plan, cumulative.event)
            else:
                yield b"data: " + first.raw + b"\n\n"
            try:
                async for batch in run.batches():
                    now = time.perf_counter()
                    itl.observe(now - last)
                    last = now
                    if relabel:
                        batch = [_relabel(ev, label) for ev in batch]
                    if cumulative is not None:
                        for ev in batch:
                            cumulative.add(ev.data)
                        out = cumulative.event()
                    elif fmt is None:
                        out = b"".join([b"data: " + ev.raw + b"\n\n" for ev in batch])
                    else:
                        out = b"".join([fmt.chunk(ev.data) for ev in batch])
                    if out:
                        yield out
            except UpstreamError as e:
                logger.warning("rid=%s failed mid-stream: %s", rid, e.message)
                status = "stream_error"
                yield sse(e.to_api_error().body()) + SSE_DONE
                return
            yield SSE_DONE if fmt is None else fmt.tail()
            status = "200"
        finally:
            run.cancel()
            self._done(route, status, t0)

    def _done(self, route: str, status: str, t0: float) -> None:
        self.metrics.requests.labels(route, status).inc()
        self.metrics.e2e.labels(route).observe(time.perf_counter() - t0)

    def _error(self, route: str, e: ApiError, rid: str, label: str | None) -> Response:
        self.metrics.requests.labels(route, str(e.status)).inc()
        if e.status >= 500:
            tag = f" label={label}" if label and label != rid else ""
            logger.warning("rid=%s%s %s: %d %s", rid, tag, route, e.status, e.message)
        return json_response(e.encode(), e.status, label or rid, e.retry_after)

