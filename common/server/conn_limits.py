"""Slow clients cannot starve real ones: file descriptors and a header deadline, for every HTTP port.

uvicorn has no header-read timeout: a socket that sends half a request line and then
nothing holds a file descriptor for ever (its keep-alive timer only runs between
requests). Two things, used by the router and every instance:

    raise_nofile_limit()       soft RLIMIT_NOFILE -> hard at startup (distributions ship a
                               soft 1,024 under a much higher hard limit; 2,000 idle sockets
                               then exhaust the process and accept() fails for real clients)
    header_timeout_protocol(s, body=BodyLimits(...))
                               uvicorn's httptools protocol, closing a connection whose
                               request head is not complete within `s` seconds of its first
                               byte (or of the connection, for a socket that sends nothing),
                               whose whole request (head + body) is not complete within
                               body.timeout_s, or whose body arrives slower than
                               body.min_rate bytes/s (over RATE_WINDOW_S windows); bodies
                               being received hold at most body.max_in_flight bytes in the
                               process together (503 and close past it); a response sent
                               before its request's body was read closes the connection
    CloseOnReject(app)         ASGI middleware: 401/413/415 answers carry `Connection: close`

uvicorn's `limit_concurrency` is not used: it answers 503 once that many connections are
open, so slow sockets would turn into 503s for real clients instead of being closed.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0
RATE_WINDOW_S = 2.0  # a body must gain body.min_rate x this many bytes in each such window
CLOSE_STATUSES = frozenset({401, 413, 415})  # the client's next bytes are not worth reading
_BUSY_BODY = b'{"error":{"message":"too many request bodies are being received","code":503}}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
         b"connection: close\r\ncontent-length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


@dataclass(frozen=True)
class BodyLimits:
    """Per-process bounds on receiving request bodies (the router's and every instance's flags)."""

    timeout_s: float = 60.0  # --body-timeout: head + body complete within this from the first byte
    min_rate: int = 1024  # --min-body-rate: bytes/s a body must keep up (0: no rate check)
    max_in_flight: int = 512 << 20  # --max-body-bytes-in-flight: unfinished bodies, all connections


class _Budget:
    """Bytes of request bodies received but not yet complete, over all connections of a process."""

    used = 0


def raise_nofile_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit; returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


class _HeaderDeadline(HttpToolsProtocol):
    """HttpToolsProtocol with a deadline on each request head (`header_timeout` seconds) and on
    each whole request (`body.timeout_s`), a minimum body rate and the process's body budget."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S
    body: BodyLimits = BodyLimits()
    budget: type[_Budget] = _Budget

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._begun = 0.0
        self._held = 0  # bytes of this connection's unfinished body counted in the budget
        self._window_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._begun = self.loop.time()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        self._window_bytes = 0
        self._body_timer = self.loop.call_later(self._next_check(), self._check_body)

    def on_body(self, body: bytes) -> None:
        if self.transport.is_closing():
            return
        self._held += len(body)
        self._window_bytes += len(body)
        self.budget.used += len(body)
        if self.budget.used > self.body.max_in_flight:
            self._refuse_busy()
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._end_body()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        answered = self.cycle is not None and self.cycle.response_complete  # not a pipelined one's
        if answered and self._body_timer is not None and not self.transport.is_closing():
            # answered before its body was read (401, 413, 503...): nothing more is worth reading
            self._end_body()
            self.transport.close()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._end_body()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _end_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self.budget.used -= self._held
        self._held = 0

    def _next_check(self) -> float:
        left = self._begun + self.body.timeout_s - self.loop.time()
        return max(0.0, min(left, RATE_WINDOW_S) if self.body.min_rate else left)

    def _check_body(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        late = self.loop.time() >= self._begun + self.body.timeout_s
        slow = self.body.min_rate and not self.flow.read_paused \
            and self._window_bytes < self.body.min_rate * RATE_WINDOW_S
        if late or slow:
            logger.debug("closing %s: request body %s", self.client,
                         f"incomplete after {self.body.timeout_s:g}s" if late else "below --min-body-rate")
            self._end_body()
            self.transport.close()
            return
        self._window_bytes = 0
        self._body_timer = self.loop.call_later(self._next_check(), self._check_body)

    def _refuse_busy(self) -> None:
        logger.warning("closing %s: unfinished request bodies exceed --max-body-bytes-in-flight", self.client)
        self._end_body()
        if self.cycle is None or self.cycle.response_started:
            self.transport.close()
            return
        self.transport.write(_BUSY)
        self.transport.close()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served (pipelined head after it): its own timeouts apply
        logger.debug("closing %s: request head incomplete after %gs", self.client, self.header_timeout)
        self.transport.close()


def header_timeout_protocol(timeout_s: float, body: BodyLimits | None = None) -> type[HttpToolsProtocol]:
    """The protocol class to pass as uvicorn's `http=` (one body budget per call, i.e. per server)."""
    budget = type("BodyBudget", (_Budget,), {"used": 0})
    return type("HeaderDeadlineProtocol", (_HeaderDeadline,),
                {"header_timeout": float(timeout_s), "body": body or BodyLimits(), "budget": budget})


class CloseOnReject:
    """ASGI middleware: a 401, 413 or 415 answer closes its connection (`Connection: close`), so a
    refused client cannot keep the socket and go on sending."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] in CLOSE_STATUSES:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)
