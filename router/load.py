"""Live load of each worker from its own report (GET /get_load), pulled on an interval.

    LoadMonitor: every --load-report-interval, GET /get_load from every routable worker at
                 once (a worker that answers 404 is not asked again); each answer lands in
                 that worker's LiveLoad; then `on_round()` (the admission queue re-checks).
    LiveLoad:    the last report, what this router sent the worker since it was asked
                 (so two requests in one interval do not both see the same empty queue),
                 and the worker's prefill rate (prompt tokens per busy second, smoothed).

A worker that never reported has `report` None: policies and admission treat it as they did
before reports existed (router-side in-flight counts only).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx
import msgspec

from common.request_mac import RequestSigner
from common.server.generate_response import LoadReport
from router.periodic import Periodic
from router.registry import WorkerRegistry
from router.worker import Worker
from router.worker_auth import WorkerAuth

logger = logging.getLogger("router.load")
_DECODER = msgspec.json.Decoder(LoadReport)


class LoadMonitor:
    def __init__(self, registry: WorkerRegistry, interval_s: float, timeout_s: float,
                 on_round: Callable[[], None], signer: RequestSigner | None = None) -> None:
        self.registry = registry
        self.auth = WorkerAuth(signer)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.on_round = on_round
        self.unsupported: set[str] = set()
        self._client: httpx.AsyncClient | None = None
        self._rounds = Periodic("load report", interval_s, self.poll_all)

    def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.timeout_s, trust_env=False, auth=self.auth)
        self._rounds.start()

    async def stop(self) -> None:
        await self._rounds.stop()
        if self._client is not None:
            await self._client.aclose()

    async def poll_all(self) -> None:
        workers = [w for w in self.registry.all() if w.health.healthy and w.url not in self.unsupported]
        await asyncio.gather(*(self._poll(w) for w in workers))
        self.on_round()

    async def _poll(self, w: Worker) -> None:
        assert self._client is not None, "LoadMonitor.start() was not called"
        asked_at = time.monotonic()
        sent = w.live.sent_tokens, w.live.sent_reqs
        try:
            resp = await self._client.get(w.url + "/get_load")
        except httpx.HTTPError:
            w.live.fail()  # the health checker judges the worker; free KV is unknown until a report lands
            return
        if resp.status_code == 404:
            self.unsupported.add(w.url)
            logger.info("worker %s has no /get_load: routed by this router's in-flight counts", w.url)
            return
        if resp.status_code != 200:
            w.live.fail()
            return
        try:
            report = _DECODER.decode(resp.content)
        except msgspec.DecodeError:
            w.live.fail()
            return
        # what was sent while the report was in flight may not be in it: keep counting that
        w.live.apply(report, asked_at, w.live.sent_tokens - sent[0], w.live.sent_reqs - sent[1])
