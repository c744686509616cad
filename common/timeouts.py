"""Bounded waits that never swallow a cancellation.

`asyncio.wait_for` before Python 3.12 returns the inner result when the caller is cancelled
in the same loop iteration as the inner awaitable completes: the cancellation is lost and the
cancelled task runs on. The router cancels an attempt's decode request when prefill fails; a
lost cancellation there made the request wait for decode's whole answer. `wait_within`
always re-raises the caller's cancellation and hands a result nobody will read to `discard`
(e.g. close a connection that opened just as the caller gave up).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def wait_within(aw: Awaitable[T], timeout_s: float, discard: Callable[[T], None] | None = None) -> T:
    """`await aw` for at most timeout_s (asyncio.TimeoutError after); cancelling the caller
    cancels `aw` and always propagates."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        if discard is not None:
            task.add_done_callback(lambda t: _discard_result(t, discard))
        raise
    if not done:
        task.cancel()
        if discard is not None:
            task.add_done_callback(lambda t: _discard_result(t, discard))
        raise asyncio.TimeoutError(f"not done within {timeout_s}s")
    return task.result()


def _discard_result(task: asyncio.Future[T], discard: Callable[[T], None]) -> None:
    if not task.cancelled() and task.exception() is None:
        discard(task.result())
