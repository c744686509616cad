"""A streaming response that the server can cut off: for a client that stopped reading.

The router and every instance queue a stream's events between the producer (a worker,
the engine) and the client's socket. A client that never reads leaves the response
blocked in its socket write while the queue grows; the owner of that queue counts it
and, past its bound, calls `StreamCutOff.cut()`: the request is aborted upstream by the
owner, and the response task is cancelled here, which makes uvicorn close the
connection (it logs "ASGI callable returned without completing response").

No extra task per stream: `cut()` cancels the task that serves the response.
"""

from __future__ import annotations

import asyncio
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


class CutOffStreamingResponse(StreamingResponse):
    """StreamingResponse that ends (connection closed, no trailer) when its StreamCutOff is cut."""

    def __init__(self, content: Any, cut_off: StreamCutOff, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.cut_off = cut_off

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        cut = self.cut_off
        if cut.was_cut:
            return
        cut.bind()
        try:
            await super().__call__(scope, receive, send)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not cut.was_cut or task is None or task.cancelling() > 1:
                raise
            task.uncancel()
        finally:
            cut.unbind()
