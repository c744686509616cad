"""Slow clients cannot starve real ones: file descriptors and a header deadline, for every HTTP port.

uvicorn has no header-read timeout: a socket that sends half a request line and then
nothing holds a file descriptor for ever (its keep-alive timer only runs between
requests). Two things, used by the router and every instance:

    raise_nofile_limit()       soft RLIMIT_NOFILE -> hard at startup (distributions ship a
                               soft 1,024 under a much higher hard limit; 2,000 idle sockets
                               then exhaust the process and accept() fails for real clients)
    header_timeout_protocol(s) uvicorn's httptools protocol, closing a connection whose
                               request head is not complete within `s` seconds of its first
                               byte (or of the connection, for a socket that sends nothing)

uvicorn's `limit_concurrency` is not used: it answers 503 once that many connections are
open, so slow sockets would turn into 503s for real clients instead of being closed.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger(__name__)

DEFAULT_HEADER_TIMEOUT_S = 10.0


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
    """HttpToolsProtocol with a deadline on each request head (`header_timeout` seconds)."""

    header_timeout: float = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            return  # a request is being served (pipelined head after it): its own timeouts apply
        logger.debug("closing %s: request head incomplete after %gs", self.client, self.header_timeout)
        self.transport.close()


def header_timeout_protocol(timeout_s: float) -> type[HttpToolsProtocol]:
    """The protocol class to pass as uvicorn's `http=`."""
    return type("HeaderDeadlineProtocol", (_HeaderDeadline,), {"header_timeout": float(timeout_s)})
