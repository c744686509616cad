"""One upstream instance as the router sees it: health, circuit breaker, load.

The registry owns Worker objects; the health checker writes `health`; the
dispatcher writes the load counters (through `LoadGuard`) and the breaker
outcomes; policies only read. All on the event loop, so no locking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from router.breaker import BreakerState, CircuitBreaker
from router.config import Role


@dataclass
class HealthState:
    healthy: bool = False  # a new worker is routable after its first successful check
    checked: bool = False
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    last_error: str | None = None

    def record(self, ok: bool, error: str | None, failure_threshold: int, success_threshold: int) -> bool:
        """Apply one check result; returns True if `healthy` changed."""
        before = self.healthy
        if ok:
            self.consecutive_successes += 1
            self.consecutive_failures = 0
            self.last_error = None
            if not self.checked or self.consecutive_successes >= success_threshold:
                self.healthy = True
        else:
            self.consecutive_failures += 1
            self.consecutive_successes = 0
            self.last_error = error
            if not self.checked or self.consecutive_failures >= failure_threshold:
                self.healthy = False
        self.checked = True
        return before != self.healthy


class Worker:
    def __init__(self, url: str, role: Role, breaker: CircuitBreaker, bootstrap_port: int | None = None) -> None:
        self.url = url
        self.role = role
        self.host = urlsplit(url).hostname or "127.0.0.1"
        self.bootstrap_port = bootstrap_port
        self.breaker = breaker
        self.health = HealthState()
        self.in_flight_requests = 0
        self.in_flight_tokens = 0
        self.total_requests = 0
        self.total_failures = 0
        self.removed = False

    @property
    def available(self) -> bool:
        """Routable now: healthy, breaker not open, and (prefill) its bootstrap port known."""
        if self.removed or not self.health.healthy or not self.breaker.allows():
            return False
        return self.role != "prefill" or self.bootstrap_port is not None

    @property
    def load(self) -> int:
        return self.in_flight_requests

    def acquire(self, tokens: int) -> LoadGuard:
        self.in_flight_requests += 1
        self.in_flight_tokens += tokens
        self.total_requests += 1
        self.breaker.on_dispatch()
        return LoadGuard(self, tokens)

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role,
            "bootstrap_port": self.bootstrap_port,
            "healthy": self.health.healthy,
            "available": self.available,
            "last_error": self.health.last_error,
            "breaker": self.breaker.state.name.lower(),
            "in_flight_requests": self.in_flight_requests,
            "in_flight_tokens": self.in_flight_tokens,
            "total_requests": self.total_requests,
            "total_failures": self.total_failures,
        }

    def __repr__(self) -> str:
        return f"Worker({self.role} {self.url})"


class LoadGuard:
    """Holds one request's share of a worker's load; `finish` releases it exactly once."""

    __slots__ = ("worker", "tokens", "_done")

    def __init__(self, worker: Worker, tokens: int) -> None:
        self.worker = worker
        self.tokens = tokens
        self._done = False

    def finish(self, outcome: bool | None) -> None:
        """outcome: True success, False worker fault, None no verdict (client gone, bad request)."""
        if self._done:
            return
        self._done = True
        w = self.worker
        w.in_flight_requests -= 1
        w.in_flight_tokens -= self.tokens
        if outcome is True:
            w.breaker.record_success()
        elif outcome is False:
            w.total_failures += 1
            w.breaker.record_failure()
        else:
            w.breaker.release_trial()


__all__ = ["BreakerState", "HealthState", "LoadGuard", "Worker"]
