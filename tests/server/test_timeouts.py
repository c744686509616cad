"""common.timeouts.wait_within: bounded, and a caller's cancellation is never lost."""

from __future__ import annotations

import asyncio

import pytest

from common.timeouts import wait_within


async def test_result_and_timeout() -> None:
    assert await wait_within(asyncio.sleep(0, result=7), 1.0) == 7
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    with pytest.raises(asyncio.TimeoutError):
        await wait_within(gate, 0.01)
    assert gate.cancelled()


async def test_cancel_in_the_iteration_the_result_arrives_still_cancels() -> None:
    """The case asyncio.wait_for (Python < 3.12) gets wrong: it returns the result instead."""
    discarded: list[int] = []
    inner: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(wait_within(inner, 5.0, discard=discarded.append))
    await asyncio.sleep(0)  # the waiter is now parked on inner
    inner.set_result(1)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await asyncio.sleep(0)
    assert discarded == [1]  # the result nobody reads is handed back for cleanup


async def test_cancel_while_waiting_cancels_the_inner_awaitable() -> None:
    inner: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    waiter = asyncio.ensure_future(wait_within(inner, 5.0, discard=lambda _: pytest.fail("nothing to discard")))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert inner.cancelled()
