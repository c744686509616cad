"""Fan-out with retries: turns a GenerationPlan into a stream of worker events.

    Dispatcher.start(plan, rid) -> RequestRun   (a producer task)
      attempt k: pick P (prefill policy) and D (decode policy), new room, Attempt.events()
        UpstreamError before the first event was handed out, retryable, k < max_retries
          -> back off (exponential, jittered), exclude the blamed worker, try again
        otherwise the error is final
      everything under one deadline (request_timeout) -> 504
    RequestRun.first() -> first event or ApiError (nothing was sent to the client yet)
    RequestRun.batches() -> the remaining events; a failure after the first event comes out
                            as an UpstreamError (the caller reports it in-band)
    RequestRun.cancel() -> client gone: cancels the producer, which closes both upstreams
    backlog: more than --max-stream-backlog events waiting for a client that does not read
             -> the producer stops (both upstreams close, the workers abort the request)
             and `run.cut_off` closes the client's connection
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections.abc import AsyncIterator
from typing import Any

from common.server.stream_cutoff import StreamCutOff
from router.config import RouterConfig
from router.errors import ApiError, UpstreamError
from router.http_client import HttpClient
from router.metrics import RouterMetrics
from router.plan import GenerationPlan
from router.registry import WorkerRegistry
from router.upstream import Attempt, WorkerEvent

logger = logging.getLogger("router.dispatch")
_END = object()


class BacklogExceeded(ApiError):
    """The client has not read its stream while `limit` events piled up for it."""

    def __init__(self, limit: int) -> None:
        super().__init__(503, f"the client did not read its stream ({limit} events waiting); request aborted",
                         type="client_too_slow")


class RequestRun:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.attempts = 0
        self.cut_off = StreamCutOff()

    async def first(self) -> WorkerEvent:
        item = await self.queue.get()
        if isinstance(item, WorkerEvent):
            return item
        if isinstance(item, UpstreamError):
            raise item.to_api_error()
        assert isinstance(item, ApiError), f"bug: unexpected first item {item!r}"
        raise item

    async def batches(self) -> AsyncIterator[list[WorkerEvent]]:
        """The remaining events, grouped by what had already arrived (one client write per group)."""
        queue = self.queue
        while True:
            batch: list[WorkerEvent] = []
            item = await queue.get()
            while True:
                if item is _END:
                    if batch:
                        yield batch
                    return
                if not isinstance(item, WorkerEvent):
                    if batch:
                        yield batch
                    if isinstance(item, ApiError):
                        raise UpstreamError(item.status, item.message, type=item.type, worker_url=None)
                    raise item
                batch.append(item)
                if queue.empty():
                    break
                item = queue.get_nowait()
            yield batch

    def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()


class Dispatcher:
    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.client: HttpClient | None = None
        self.background: set[asyncio.Task[Any]] = set()

    def open(self) -> None:
        self.client = HttpClient(max_per_origin=self.cfg.max_connections, connect_timeout=self.cfg.connect_timeout)

    async def close(self) -> None:
        for t in list(self.background):
            t.cancel()
        await asyncio.gather(*self.background, return_exceptions=True)
        if self.client is not None:
            await self.client.aclose()

    def start(self, plan: GenerationPlan, rid: str) -> RequestRun:
        run = RequestRun()
        run.task = asyncio.ensure_future(self._produce(run, plan, rid))
        return run

    async def _produce(self, run: RequestRun, plan: GenerationPlan, rid: str) -> None:
        put = run.queue.put_nowait
        try:
            async with asyncio.timeout(self.cfg.request_timeout):
                await self._attempts(run, plan, rid)
            put(_END)
        except BacklogExceeded as e:
            self.metrics.errors.labels(e.type).inc()
            logger.warning("rid=%s %s", rid, e.message)
            put(e)
            run.cut_off.cut()
        except TimeoutError:
            self.metrics.errors.labels("timeout").inc()
            put(UpstreamError(504, f"request timed out after {self.cfg.request_timeout:g} s", type="timeout",
                              worker_url=None))
        except (UpstreamError, ApiError) as e:
            self.metrics.errors.labels(e.type).inc()
            if isinstance(e, UpstreamError):  # the client sees e.public; the worker and its words go here
                logger.warning("rid=%s failed: %d %s", rid, e.status, e.message)
            put(e)
        except Exception as e:  # a bug: still reaches the client
            logger.exception("rid=%s dispatch failed", rid)
            put(UpstreamError(500, f"router internal error: {type(e).__name__}: {e}", type="internal_error",
                              worker_url=None, public="router internal error"))

    async def _attempts(self, run: RequestRun, plan: GenerationPlan, rid: str) -> None:
        assert self.client is not None, "Dispatcher.open() was not called"
        put = run.queue.put_nowait
        qsize = run.queue.qsize
        backlog = self.cfg.max_stream_backlog
        exclude: set[str] = set()
        last_error: UpstreamError | None = None
        for k in range(self.cfg.max_retries + 1):
            try:
                decode, prefill = self._pick(plan, frozenset(exclude))
            except ApiError:
                if last_error is not None:
                    raise last_error from None
                raise
            run.attempts = k + 1
            attempt = Attempt(self.client, plan, rid if k == 0 else f"{rid}.r{k}", decode, prefill,
                              secrets.randbits(63), self.background)
            sent = False
            ok = False
            try:
                async for ev in attempt.events():
                    put(ev)
                    sent = True
                    if qsize() > backlog:
                        raise BacklogExceeded(backlog)
                ok = True
                return
            except UpstreamError as e:
                attempt.fail(e)
                if sent or not e.retryable or k == self.cfg.max_retries:
                    raise
                last_error = e
                if e.worker_url:
                    exclude.add(e.worker_url)
                self.metrics.retries.labels(e.type).inc()
                logger.info("rid=%s attempt %d failed (%s), retrying", rid, k + 1, e.message)
            finally:
                await attempt.aclose(cancel_prefill=not ok)
            await asyncio.sleep(self._backoff(k))

    def _pick(self, plan: GenerationPlan, exclude: frozenset[str]) -> tuple[Any, Any]:
        reg = self.registry
        if not self.cfg.disaggregated:
            return reg.select("colocated", plan.input_ids, exclude), None
        prefill = reg.select("prefill", plan.input_ids, exclude)
        decode = reg.select("decode", plan.input_ids, exclude)
        return decode, prefill

    def _backoff(self, k: int) -> float:
        base = min(self.cfg.retry_backoff_max, self.cfg.retry_backoff_initial * (2**k))
        return base * random.uniform(0.5, 1.5)
