"""The router's bounded waiting queue: a request is dispatched only to a decode with room.

    admit(plan)
      no one waiting and some decode has room    -> go at once
      --max-queued-requests already waiting      -> 503 + Retry-After at once
      else wait (FIFO) until the head finds room -> go
           --queue-timeout passed first          -> 503 + Retry-After (opt-in; default no limit)
    notify()   a request finished or load reports arrived: the head re-checks
    parsing()  a big body parsed off the loop holds a queue place meanwhile (check_full counts it)

A decode has room for a request when the router's in-flight requests on it are below its
reported max_running_requests and its predicted free KV tokens (report minus what this router
sent since) cover the request's prompt + max_new_tokens. A worker without a load report has
room (as before reports existed), and so does one whose last report failed or timed out
(router/live_load.py: its free KV is unknown, only the request-count bound holds): a missing
report never reads as "no room". With no routable decode at all nothing waits here (the
dispatcher answers 503 no_healthy_worker). The check and the pick run with no await in between,
so a woken request takes its room before any other task looks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterator

from router.config import Role, RouterConfig
from router.errors import ApiError
from router.metrics import RouterMetrics
from router.plan import GenerationPlan
from router.registry import WorkerRegistry
from router.worker import Worker

RETRY_AFTER_S = 1  # room frees as streams finish; a client should come back soon, not at once


def has_room(w: Worker, tokens: int) -> bool:
    report = w.live.report
    if report is None:
        return True
    if report.max_running_requests > 0 and w.in_flight_requests >= report.max_running_requests:
        return False
    free = w.live.free_kv_tokens
    return free is None or tokens > report.kv_total_tokens or tokens <= free


class Admission:
    def __init__(self, cfg: RouterConfig, registry: WorkerRegistry, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.registry = registry
        self.metrics = metrics
        self.role: Role = "decode" if cfg.disaggregated else "colocated"
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.parsing_now = 0  # bodies being parsed in the parse pool (queued there or running)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def room(self, plan: GenerationPlan) -> bool:
        decodes = self.registry.available(self.role)
        tokens = len(plan.input_ids) + plan.max_new_tokens
        return not decodes or any(has_room(d, tokens) for d in decodes)

    def check_full(self) -> None:
        """503 at once if the queue is full (a new request would have to wait behind it): the
        handler calls this before it reads the body, so overload costs little router CPU."""
        if len(self._waiters) + self.parsing_now >= self.cfg.max_queued_requests:
            self.metrics.queue_rejected.labels("full").inc()
            raise self._busy(f"the router's queue is full ({self.cfg.max_queued_requests} requests wait for a "
                             f"decode with room or for parsing)", "queue_full")

    @contextlib.contextmanager
    def parsing(self) -> Iterator[None]:
        """A place in the queue while a big body waits for (and runs in) the parse pool; 503 if full."""
        self.check_full()
        self.parsing_now += 1
        try:
            yield
        finally:
            self.parsing_now -= 1

    async def admit(self, plan: GenerationPlan) -> None:
        if not self._waiters and self.room(plan):
            return
        self.check_full()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(self.cfg.queue_timeout):
                while True:
                    await fut
                    if self.room(plan):
                        return
                    fut = asyncio.get_running_loop().create_future()
                    self._waiters[0] = fut  # still the head: wait for the next release or report
        except TimeoutError:
            self.metrics.queue_rejected.labels("timeout").inc()
            raise self._busy(f"no decode had room within --queue-timeout {self.cfg.queue_timeout:g} s",
                             "queue_timeout") from None
        finally:
            if self._waiters and self._waiters[0] is fut:
                self._waiters.popleft()
            elif fut in self._waiters:
                self._waiters.remove(fut)
            self.notify()

    def notify(self) -> None:
        """Wake the head of the queue (it re-checks for room, then wakes the next)."""
        if self._waiters and not self._waiters[0].done():
            self._waiters[0].set_result(None)

    def _busy(self, message: str, code: str) -> ApiError:
        return ApiError(503, message, type="service_unavailable", code=code, retry_after=RETRY_AFTER_S)
