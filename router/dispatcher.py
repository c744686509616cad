"""Fan-out with retries: turns a GenerationPlan into a stream of worker events.

    Dispatcher.start(plan, rid) -> RequestRun   (a producer task)
      attempt k: pick P (prefill policy) and D (decode policy), new room, Attempt.events()
        UpstreamError before the first event was handed out, retryable, k < max_retries
          -> back off (exponential, jittered), exclude the blamed worker, try again
        UpstreamError after events went out (a stream), blamed on decode, retryable, and
        --max-migrations not used up -> migrate (router/migration.py): the same stream goes
          on from a new pair with prompt + the tokens sent, max_new_tokens reduced
        otherwise the error is final
      everything under one deadline (request_timeout) -> 504
    before the first attempt: Admission.admit (router/admission.py), the bounded wait for a
      decode with room; the decode is then picked among those with room
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
from functools import partial
from typing import Any

from common.request_mac import RequestSigner
from common.server.stream_cutoff import StreamCutOff
from router.admission import Admission, has_room
from router.config import RouterConfig
from router.errors import ApiError, UpstreamError
from router.http_client import HttpClient
from router.kv_index import KVIndexes
from router.metrics import RouterMetrics
from router.migration import Migration
from router.pair_choice import PairChooser
from router.plan import GenerationPlan
from router.registry import WorkerRegistry
from router.turn_events import PendingTurn, PendingTurns
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
    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, metrics: RouterMetrics,
                 admission: Admission, kv_indexes: KVIndexes, signer: RequestSigner | None = None) -> None:
        self.cfg = cfg
        self.signer = signer
        self.registry = registry
        self.metrics = metrics
        self.admission = admission
        self.pairs = PairChooser(cfg, registry, kv_indexes.cached_tokens)
        self.kv_indexes = kv_indexes
        self.pending_turns = PendingTurns()
        self.client: HttpClient | None = None
        self.background: set[asyncio.Task[Any]] = set()

    def open(self) -> None:
        self.client = HttpClient(max_per_origin=self.cfg.max_connections, connect_timeout=self.cfg.connect_timeout,
                                 signer=self.signer)

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
        migration = Migration(plan, self.cfg.max_migrations)
        retries = 0
        await self.admission.admit(plan)
        await self._await_last_turn(plan)
        while True:
            try:
                decode, prefill = self._pick(migration.plan, frozenset(exclude))
            except ApiError:
                if last_error is not None:
                    raise last_error from None
                raise
            run.attempts += 1
            name = rid if run.attempts == 1 else f"{rid}.{'m' if migration.count else 'r'}{run.attempts - 1}"
            attempt = Attempt(self.client, migration.plan, name, decode, prefill, secrets.randbits(63),
                              self.background)
            sent = False
            ok = False
            try:
                async for ev in attempt.events():
                    ev = migration.adapt(ev)
                    migration.record(ev)
                    put(ev)
                    sent = True
                    if qsize() > backlog:
                        raise BacklogExceeded(backlog)
                ok = True
                self._turn_ended(migration, decode.url)
                return
            except UpstreamError as e:
                attempt.fail(e)
                if e.worker_url:
                    exclude.add(e.worker_url)
                if sent:
                    if not migration.allows(e, decode.url):
                        raise
                    migration.next_plan()
                    last_error = e  # no pair left to migrate to: the client hears this, the cause
                    self.metrics.migrations.labels(e.type).inc()
                    logger.warning("rid=%s decode %s failed after %d tokens (%s): migrating (%d of %d)", rid,
                                   decode.url, len(migration.generated), e.message, migration.count,
                                   self.cfg.max_migrations)
                    continue
                if not e.retryable or retries == self.cfg.max_retries:
                    raise
                last_error = e
                self.metrics.retries.labels(e.type).inc()
                logger.info("rid=%s attempt %d failed (%s), retrying", rid, run.attempts, e.message)
            finally:
                await attempt.aclose(cancel_prefill=not ok)
                self.admission.notify()
            await asyncio.sleep(self._backoff(retries))
            retries += 1

    async def _await_last_turn(self, plan: GenerationPlan) -> None:
        """A session's turn waits (bounded) until its last turn's pages are in decode's index."""
        if plan.session_id is None or self.cfg.kv_event_wait <= 0:
            return
        turn = self.pending_turns.take(plan.session_id)
        if turn is not None:
            await self.kv_indexes.wait_for_page(turn.decode_url, turn.page_hash, self.cfg.kv_event_wait)

    def _turn_ended(self, migration: Migration, decode_url: str) -> None:
        plan = migration.origin
        if plan.session_id is None or self.cfg.kv_event_wait <= 0 or not migration.generated:
            return
        cached = [*plan.input_ids, *migration.generated[:-1]]  # the last token has no KV yet
        page = self.kv_indexes.last_page_hash(decode_url, cached)
        if page is not None:
            self.pending_turns.ended(plan.session_id, PendingTurn(decode_url, page))

    def _pick(self, plan: GenerationPlan, exclude: frozenset[str]) -> tuple[Any, Any]:
        room = partial(has_room, tokens=len(plan.input_ids) + plan.max_new_tokens)
        if not self.cfg.disaggregated:
            return self.registry.select("colocated", plan.input_ids, exclude, prefer=room), None
        pair = self.pairs.choose(plan, exclude, room)
        self.metrics.decode_choice.labels(pair.reason, "local" if pair.prefill is None else "prefill").inc()
        return pair.decode, pair.prefill

    def _backoff(self, k: int) -> float:
        base = min(self.cfg.retry_backoff_max, self.cfg.retry_backoff_initial * (2**k))
        return base * random.uniform(0.5, 1.5)
