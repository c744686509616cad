"""Per-worker circuit breaker.

    CLOSED --(failure_threshold consecutive failures)--> OPEN
    OPEN   --(open_seconds elapsed)--------------------> HALF_OPEN (one trial request at a time)
    HALF_OPEN --(success_threshold successes)----------> CLOSED
    HALF_OPEN --(any failure)--------------------------> OPEN

Owned by its Worker; the dispatcher records outcomes, policies only ask `allows()`.
Single-threaded (event loop), so no locking.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int,
        success_threshold: int,
        open_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.open_seconds = open_seconds
        self._clock = clock
        self._state = BreakerState.CLOSED
        self._failures = 0
        self._successes = 0
        self._opened_at = 0.0
        self._trial_in_flight = False

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.open_seconds:
            self._state = BreakerState.HALF_OPEN
            self._successes = 0
            self._trial_in_flight = False
        return self._state

    def allows(self) -> bool:
        """May a request be routed here now? (HALF_OPEN: only if no trial is running.)"""
        state = self.state
        return state is BreakerState.CLOSED or (state is BreakerState.HALF_OPEN and not self._trial_in_flight)

    def on_dispatch(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def record_success(self) -> None:
        state = self.state
        self._failures = 0
        if state is BreakerState.HALF_OPEN:
            self._trial_in_flight = False
            self._successes += 1
            if self._successes >= self.success_threshold:
                self._state = BreakerState.CLOSED

    def record_failure(self) -> None:
        state = self.state
        self._failures += 1
        if state is BreakerState.HALF_OPEN or self._failures >= self.failure_threshold:
            self._trip()

    def release_trial(self) -> None:
        """A dispatched request ended without an outcome (client gone, 4xx): free the trial slot."""
        self._trial_in_flight = False

    def _trip(self) -> None:
        self._state = BreakerState.OPEN
        self._opened_at = self._clock()
        self._failures = 0
        self._successes = 0
        self._trial_in_flight = False
