"""CutOffStreamingResponse in-process, under the ASGI 2.3 path uvicorn takes (the body streams
from a child task; the cut cancels the parent): a body that still has the owner's last events in
hand when the cut comes writes nothing more, and the response never completes (no trailer)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from common.server.stream_cutoff import CutOffStreamingResponse, StreamCutOff

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "GET", "path": "/"}


async def _serve(body: AsyncIterator[bytes], cut: StreamCutOff) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(30)  # the client never sends anything (bounded: the test fails, not hangs)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)  # a socket that accepts every write at once: nothing to cancel there

    await asyncio.wait_for(CutOffStreamingResponse(body, cut)(SCOPE, receive, send), 10)
    return sent


def test_a_cut_while_the_body_holds_events_writes_nothing_more() -> None:
    cut = StreamCutOff()

    async def body() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        # The owner cuts while this task runs with its last events already in hand (the race:
        # the cancellation has not reached the child task yet).
        cut.cut()
        yield b'data: {"error": "too slow"}\n\ndata: [DONE]\n\n'

    sent = asyncio.run(_serve(body(), cut))
    bodies = [m.get("body", b"") for m in sent if m["type"] == "http.response.body"]
    assert bodies == [b"data: 1\n\n"], sent
    assert all(m.get("more_body", False) for m in sent if m["type"] == "http.response.body"), "completed"


def test_an_uncut_stream_completes() -> None:
    cut = StreamCutOff()

    async def body() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        yield b"data: [DONE]\n\n"

    sent = asyncio.run(_serve(body(), cut))
    bodies = [m.get("body", b"") for m in sent if m["type"] == "http.response.body"]
    assert b"".join(bodies) == b"data: 1\n\ndata: [DONE]\n\n"
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
