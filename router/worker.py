"""One upstream instance as the router sees it: health, circuit breaker, load.

The registry owns Worker objects; the health checker writes `health`; the
dispatcher writes the load counters (through `LoadGuard`), the breaker
outcomes and `last_progress_at` (every answer or streamed event from the
worker: proof of life the health state weighs against a failed probe);
policies only read. All on the event loop, so no locking.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from router.breaker import BreakerState, CircuitBreaker
from router.config import Role
from router.health_state import HealthState
from router.live_load import LiveLoad


@dataclass(frozen=True)
class CacheInfo:
    """What a worker's /server_info says about its prefix cache (learned by the health checker,
    forgotten when it goes down: a restarted worker may publish elsewhere)."""

    kv_events_endpoint: str | None  # ZMQ PUB of its KV events (router/kv_index.py); None: publishes none
    local_prefill_max_tokens: int  # decode: serves a prompt alone when at most this many tokens are not cached


class Worker:
    def __init__(self, url: str, role: Role, breaker: CircuitBreaker, bootstrap_port: int | None = None) -> None:
        self.url = url
        self.role = role
        self.host = urlsplit(url).hostname or "127.0.0.1"
        self.bootstrap_port = bootstrap_port
        self.breaker = breaker
        self.health = HealthState()
        self.last_progress_at: float | None = None
        self.in_flight_requests = 0
        self.in_flight_tokens = 0
        self.total_requests = 0
        self.total_failures = 0
        self.removed = False
        self.cache_info: CacheInfo | None = None
        self.live = LiveLoad()  # the worker's own load report (router/load.py)
        self.source = "command-line"  # how the router found it (WorkerSpec.source); the registry sets it
        self.pod: str | None = None
        self.name = url  # public label (metrics): `<role>-<n>`; the registry sets it

    @property
    def available(self) -> bool:
        """Routable now: healthy, breaker not open, and (prefill) its bootstrap port known."""
        if self.removed or not self.health.healthy or not self.breaker.allows():
            return False
        return self.role != "prefill" or self.bootstrap_port is not None

    @property
    def panic_available(self) -> bool:
        """Routable in panic mode (no healthy worker of the role): down by probes alone, still answering."""
        if self.removed or not self.health.panic_routable or not self.breaker.allows():
            return False
        return self.role != "prefill" or self.bootstrap_port is not None

    @property
    def load(self) -> int:
        """In-flight requests, plus a penalty while its health probes time out (a busy worker)."""
        return self.in_flight_requests + self.health.load_penalty

    def note_progress(self) -> None:
        """The worker answered a request or streamed an event: it is alive."""
        self.last_progress_at = time.monotonic()

    def acquire(self, tokens: int) -> LoadGuard:
        self.in_flight_requests += 1
        self.in_flight_tokens += tokens
        self.total_requests += 1
        self.live.on_dispatch(tokens)
        self.breaker.on_dispatch()
        return LoadGuard(self, tokens)

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "name": self.name,
            "role": self.role,
            "bootstrap_port": self.bootstrap_port,
            "source": self.source,
            "pod": self.pod,
            "healthy": self.health.healthy,
            "available": self.available,
            "last_error": self.health.last_error,
            "down_kind": self.health.down_kind,
            "probe_timeouts": self.health.consecutive_timeouts,
            "load": self.load,
            "breaker": self.breaker.state.name.lower(),
            "in_flight_requests": self.in_flight_requests,
            "in_flight_tokens": self.in_flight_tokens,
            "total_requests": self.total_requests,
            "total_failures": self.total_failures,
            "load_report": self.live.describe(),
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


__all__ = ["BreakerState", "CacheInfo", "HealthState", "LoadGuard", "Worker"]
