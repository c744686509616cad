"""The frontend's view of the engine's stats: at most one StatsReq in flight, answers shared.

Owned by the TokenizerManager (one event loop). Every caller (the 1 s refresh loop,
/metrics, /get_load, /health_generate) goes through `fetch`:

    stats = await engine_stats.fetch(timeout_s, max_age_s=1.0)   # /metrics: cached when still true
    stats = await engine_stats.fetch(timeout_s)                   # /get_load: an answer sent after now

While a StatsReq is unanswered no other is sent; callers join it if it was sent after they
arrived (`marks()`: engine steps and frontend<->engine messages seen), else wait for it and
share the next. With max_age_s, the last answer is served as long as no step ran and no
request message passed since it was asked for, and it is younger than max_age_s: a scrape
flood costs the engine at most one stats build per max_age_s while idle, one at a time
when busy (one per step at most), never one per scrape.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

RESEND_AFTER_S = 10.0  # an unanswered StatsReq (lost, or a very long step) no longer blocks a new one


@dataclass
class _Asked:
    seq: int
    marks: tuple[int, int]
    sent_at: float
    answer: asyncio.Future[dict[str, float]]


class StatsUnavailable(Exception):
    """The engine takes no message, or did not answer within the caller's timeout."""


class EngineStats:
    def __init__(self, send: Callable[[int], bool], steps: Callable[[], int]) -> None:
        """send(seq): queue StatsReq(seq) to the engine (False: it takes no message);
        steps(): scheduler steps the engine has begun (the step clock)."""
        self._send = send
        self._steps = steps
        self._next_seq = 1
        self.activity = 0  # bumped by the owner for each request sent to / output received from the engine
        self.requests_sent = 0
        self._asked: _Asked | None = None
        self._last: _Asked | None = None  # the latest answered request
        self.answered_at = 0.0
        self.last_stats: dict[str, float] = {}

    def marks(self) -> tuple[int, int]:
        return self._steps(), self.activity

    def _ask(self) -> _Asked | None:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        if not self._send(seq):
            return None
        self.requests_sent += 1
        self._asked = _Asked(seq, self.marks(), time.monotonic(), asyncio.get_running_loop().create_future())
        return self._asked

    def _current(self) -> _Asked | None:
        """The request in flight, unless answered or given up on."""
        a = self._asked
        if a is None or a.answer.done() or time.monotonic() - a.sent_at > RESEND_AFTER_S:
            return None
        return a

    def refresh(self) -> None:
        """The background refresh: ask unless a request is in flight."""
        if self._current() is None:
            self._ask()

    def answered(self, seq: int, stats: dict[str, float]) -> None:
        """A StatsResp(seq) arrived (any seq: the engine answers in order)."""
        a = self._asked
        if a is not None and a.seq == seq:
            self._last = a
            self.answered_at = time.monotonic()
            self.last_stats = stats
            if not a.answer.done():
                a.answer.set_result(stats)

    def fail(self, reason: str) -> None:
        """The engine is gone: whoever waits on the request in flight gets StatsUnavailable now."""
        a, self._asked = self._asked, None
        if a is not None and not a.answer.done():
            a.answer.set_exception(StatsUnavailable(reason))
            a.answer.exception()  # retrieved: no "never retrieved" warning when nobody waits

    async def fetch(self, timeout_s: float, max_age_s: float = 0.0) -> dict[str, float]:
        """Stats asked for no earlier than this call (or the last answer, while still true and
        younger than max_age_s); StatsUnavailable past timeout_s."""
        arrived = self.marks()
        last = self._last
        if (max_age_s > 0 and last is not None and last.marks == arrived
                and time.monotonic() - self.answered_at <= max_age_s):
            return self.last_stats
        deadline = time.monotonic() + timeout_s
        while True:
            a = self._current()
            if a is None:
                a = self._ask()
                if a is None:
                    raise StatsUnavailable("the engine is not taking messages")
            left = deadline - time.monotonic()
            try:
                stats = await asyncio.wait_for(asyncio.shield(a.answer), max(left, 0.0))
            except asyncio.TimeoutError:
                raise StatsUnavailable(f"the engine did not answer a stats probe within {timeout_s}s") from None
            if a.marks[0] >= arrived[0] and a.marks[1] >= arrived[1]:
                return stats
