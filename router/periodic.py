"""A round of work repeated on the event loop: the health checks and the load reports."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger("router")


class Periodic:
    """Runs `run_round` every `interval_s` from start() until stop(); a round that raises is logged
    and the next one runs anyway. Owned by HealthChecker and LoadMonitor."""

    def __init__(self, what: str, interval_s: float, run_round: Callable[[], Awaitable[None]]) -> None:
        self.what = what
        self.interval_s = interval_s
        self.run_round = run_round
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            try:
                await self.run_round()
            except Exception:
                logger.exception("%s round failed", self.what)
            await asyncio.sleep(self.interval_s)
