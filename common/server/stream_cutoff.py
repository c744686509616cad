"""A streaming response that the server can cut off: for a client that stopped reading.

The router and every instance queue a stream's events between the producer (a worker,
the engine) and the client's socket. A client that never reads leaves the response
blocked in its socket write while the queue grows; the owner of that queue counts it
and, past its bound, calls `StreamCutOff.cut()`: the request is aborted upstream by the
owner, and the response task is cancelled here, which makes uvicorn close the
connection (it logs "ASGI callable returned without completing response").

No extra task per stream: `cut()` cancels the task that serves the response. Starlette streams
from a child task of that one (ASGI spec < 2.4, uvicorn's case), and anyio delivers the
cancellation to the child only once its pending wait is not already satisfied: a child that has
the owner's last events in hand could write them, and the stream's normal end, first. So the
body is also checked chunk by chunk: after the cut nothing more is written.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse


class StreamCutOff:
    """One stream's cut-off switch; `cut()` is safe before, during and after the response."""

    __slots__ = ("_task", "was_cut")

    def __init__(self) -> None:
        self._task: asyncio.Task[Any] | None = None
        self.was_cut = False

    def cut(self) -> None:
        if self.was_cut:
            return
        self.was_cut = True
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def bind(self) -> None:
        self._task = asyncio.current_task()

    def unbind(self) -> None:
        self._task = None


class StreamWasCut(Exception):
    """Raised in place of a chunk the body produced after the cut (never reaches the client)."""


class CutOffStreamingResponse(StreamingResponse):
    """StreamingResponse that ends (connection closed, no trailer) when its StreamCutOff is cut."""

    def __init__(self, content: Any, cut_off: StreamCutOff, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.cut_off = cut_off
        self.body_iterator = self._until_cut(self.body_iterator)

    async def _until_cut(self, body: AsyncIterable[Any]) -> AsyncIterator[Any]:
        async for chunk in body:
            if self.cut_off.was_cut:
                raise StreamWasCut
            yield chunk

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        cut = self.cut_off
        if cut.was_cut:
            return
        cut.bind()
        try:
            await super().__call__(scope, receive, send)
        except (asyncio.CancelledError, StreamWasCut):
            task = asyncio.current_task()
            if not cut.was_cut or task is None or task.cancelling() > 1:
                raise
            if task.cancelling():
                task.uncancel()
        finally:
            cut.unbind()
