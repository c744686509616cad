"""One attempt of one request against a worker pair (or one colocated worker).

    Attempt.events():
      P <- POST /generate (stream=false, bootstrap fields)   } sent at once,
      D <- POST /generate (stream=plan.stream, same fields)  } same room
      race: D's first event  vs  P's failure
        P fails first  -> close D, raise P's error (never an empty 200)
        D's event first -> yield it, then the rest of D's events; P finishes in the
                           background and only its failure is recorded
    Colocated: only D (the worker), no bootstrap fields.

Every failure is an UpstreamError naming the worker to blame; `aclose()` closes
both upstream connections (workers abort on disconnect) and releases the load.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from router.errors import UpstreamError
from router.http_client import ConnectFailed, HttpClient, HttpError, Response
from router.plan import Bootstrap, GenerationPlan
from router.worker import LoadGuard, Worker

logger = logging.getLogger("router.upstream")
_DECODER = msgspec.json.Decoder()
DONE = b"[DONE]"


class SSEParser:
    """Bytes of a text/event-stream -> the `data:` payload of each event (multi-line data joined)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        *events, self._buf = buf.split(b"\n\n")
        out = []
        for ev in events:
            data = [line[5:].lstrip(b" ") for line in ev.split(b"\n") if line.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data))
        return out


class WorkerEvent(msgspec.Struct):
    """One decoded event from a worker; `raw` is its JSON as received (for passthrough)."""

    raw: bytes
    data: dict[str, Any]


def _connection_error(e: HttpError, worker: Worker) -> UpstreamError:
    if isinstance(e, ConnectFailed):
        return UpstreamError(503, f"{worker.url}: {e}", type="worker_unreachable", worker_url=worker.url,
                             public="a worker could not be reached")
    return UpstreamError(502, f"{worker.url}: {e}", type="worker_connection_lost", worker_url=worker.url,
                         public="the connection to a worker was lost")


def _check_event(data: Any, raw: bytes, worker: Worker) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise UpstreamError(502, f"{worker.url}: malformed event {raw[:200]!r}", type="bad_upstream_response",
                            worker_url=worker.url)
    if "error" in data:
        raise UpstreamError.from_event(data["error"], worker.url)
    fr = (data.get("meta_info") or {}).get("finish_reason")
    if isinstance(fr, dict) and fr.get("type") == "abort":
        raise UpstreamError.from_event({"message": fr.get("message") or "request aborted by the worker",
                                        "code": fr.get("status_code"), "type": "aborted"}, worker.url)
    return data


class Attempt:
    def __init__(
        self,
        client: HttpClient,
        plan: GenerationPlan,
        rid: str,
        decode: Worker,
        prefill: Worker | None,
        room: int,
        background: set[asyncio.Task[Any]],
    ) -> None:
        self.client = client
        self.plan = plan
        self.rid = rid
        self.decode = decode
        self.prefill = prefill
        self.room = room
        self._background = background
        boot = None
        if prefill is not None:
            assert prefill.bootstrap_port is not None, "bug: prefill without a bootstrap port was selected"
            boot = Bootstrap(prefill.host, prefill.bootstrap_port, room)
        self._boot = boot
        n_prompt = len(plan.input_ids)
        self.d_guard: LoadGuard = decode.acquire(n_prompt + plan.max_new_tokens)
        self.p_guard: LoadGuard | None = prefill.acquire(n_prompt) if prefill is not None else None
        self._p_task: asyncio.Task[None] | None = None
        self._d_resp: Response | None = None
        self._first_task: asyncio.Future[WorkerEvent] | None = None
        self.prefill_error: UpstreamError | None = None
        self.prefill_meta: dict[str, Any] = {}
        self.decode_started = False

    @property
    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.rid, "Content-Type": "application/json"}

    async def events(self) -> AsyncIterator[WorkerEvent]:
        """D's events; raises UpstreamError. The caller must `aclose()` in a finally."""
        if self.prefill is not None:
            self._p_task = asyncio.ensure_future(self._run_prefill(self.prefill))
        d_events = self._decode_events()
        first_task = self._first_task = asyncio.ensure_future(d_events.__anext__())
        if self._p_task is not None:
            await asyncio.wait((first_task, self._p_task), return_when=asyncio.FIRST_COMPLETED)
            p_done = self._p_task.done() and not self._p_task.cancelled()
            exc = self._p_task.exception() if p_done else None
            if not first_task.done() and exc is not None and not _decode_gave_up(exc):
                first_task.cancel()
                await asyncio.gather(first_task, return_exceptions=True)
                assert isinstance(exc, UpstreamError)
                raise exc
        try:
            first = await first_task
        except StopAsyncIteration:
            raise UpstreamError(502, f"{self.decode.url}: empty response stream", type="bad_upstream_response",
                                worker_url=self.decode.url) from None
        if self._p_task is not None and self.plan.prompt_logprob_start >= 0:
            first = await self._with_prompt_logprobs(first)
        self.decode_started = True
        self.decode.note_progress()
        yield first
        async for ev in d_events:
            self.decode.note_progress()  # proof of life for the health checker, whatever /health says
            yield ev
        self.d_guard.finish(True)

    async def _with_prompt_logprobs(self, first: WorkerEvent) -> WorkerEvent:
        """Prompt logprobs are computed by the prefill instance: wait for its answer and put them
        into decode's first event (decode answers only for the tokens it produced)."""
        assert self._p_task is not None
        await self._p_task
        extra = {k: v for k, v in self.prefill_meta.items() if k in ("input_token_logprobs", "input_top_logprobs")}
        if not extra:
            return first
        data = {**first.data, "meta_info": {**(first.data.get("meta_info") or {}), **extra}}
        return WorkerEvent(msgspec.json.encode(data), data)

    async def _decode_events(self) -> AsyncIterator[WorkerEvent]:
        d = self.decode
        body = self.plan.worker_body(self.rid, self._boot, stream=self.plan.worker_stream)
        try:
            resp = self._d_resp = await self.client.post(d.url, "/generate", body, self.headers)
            if resp.status != 200:
                raise UpstreamError.from_body(resp.status, await resp.read(), d.url)
            if not self.plan.worker_stream:
                raw = await resp.read()
                yield WorkerEvent(raw, _check_event(_decode(raw, d), raw, d))
                return
            parser = SSEParser()
            done = False
            async for chunk in resp.iter_body():
                for raw in parser.feed(chunk):
                    if raw == DONE:
                        done = True  # read on to the end of the body: the connection goes back to the pool
                    elif not done:
                        yield WorkerEvent(raw, _check_event(_decode(raw, d), raw, d))
            if done:
                return
        except HttpError as e:
            raise _connection_error(e, d) from None
        raise UpstreamError(502, f"{d.url}: stream ended without [DONE]", type="worker_connection_lost",
                            worker_url=d.url)

    async def _run_prefill(self, p: Worker) -> None:
        body = self.plan.worker_body(self.rid, self._boot, stream=False)
        guard = self.p_guard
        assert guard is not None
        try:
            resp = None
            try:
                resp = await self.client.post(p.url, "/generate", body, self.headers)
                raw = await resp.read()
            except HttpError as e:
                raise _connection_error(e, p) from None
            finally:
                if resp is not None:
                    await resp.aclose()
            if resp.status != 200:
                raise UpstreamError.from_body(resp.status, raw, p.url)
            self.prefill_meta = _check_event(_decode(raw, p), raw, p).get("meta_info") or {}
            p.note_progress()
        except UpstreamError as e:
            self.prefill_error = e
            guard.finish(False if e.worker_fault else None)
            raise
        except asyncio.CancelledError:
            guard.finish(None)
            raise
        guard.finish(True)

    def fail(self, err: UpstreamError | None) -> None:
        """Record the attempt's verdict on the decode side (None: no verdict, e.g. client gone)."""
        if err is None:
            self.d_guard.finish(None)
        else:
            self.d_guard.finish(False if err.worker_url == self.decode.url and err.worker_fault else None)

    async def aclose(self, *, cancel_prefill: bool) -> None:
        """Close D's connection; cancel P unless the request succeeded (then let it drain)."""
        self.d_guard.finish(None)  # no-op if an outcome was already recorded
        p_task = self._p_task
        if cancel_prefill and p_task is not None and not p_task.done():
            p_task.cancel()  # before D hears of it: P's answer to D's abort must not count against P
        first = self._first_task
        if first is not None and not first.done():  # cancelled while waiting for D's first event
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        if self._d_resp is not None:
            await self._d_resp.aclose()
        if p_task is None:
            return
        if p_task.done():
            self._prefill_drained(p_task)
        else:
            self._background.add(p_task)
            p_task.add_done_callback(self._prefill_drained)

    def _prefill_drained(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        _consume(task)
        if self.p_guard is not None:
            self.p_guard.finish(None)  # no-op unless the task was cancelled before it ever ran
        if self.prefill_error is not None and self.decode_started:
            logger.warning("rid=%s prefill failed after decode started: %s", self.rid, self.prefill_error.message)


def _decode_gave_up(exc: BaseException) -> bool:
    """P's 499: decode abandoned the transfer; D's own answer (its error or stream) says why."""
    return isinstance(exc, UpstreamError) and exc.status == 499


def _consume(task: asyncio.Task[None]) -> None:
    if not task.cancelled():
        task.exception()  # mark retrieved


def _decode(raw: bytes, worker: Worker) -> Any:
    try:
        return _DECODER.decode(raw)
    except msgspec.DecodeError:
        raise UpstreamError(502, f"{worker.url}: response is not JSON: {raw[:200]!r}",
                            type="bad_upstream_response", worker_url=worker.url) from None
