"""One worker's health as the router sees it: slow is not dead.

    probe answered 200                         -> success (failure_threshold in a row... reset)
    the worker answered a request or streamed
      a token since the previous probe         -> success, whatever the probe says
    probe timed out                            -> no verdict; the load estimate goes up
      ... and nothing answered for unresponsive_after_s -> failure "unresponsive"
    connection refused / reset, non-200 answer -> failure

`failure_threshold` failures in a row mark the worker down (an unresponsive verdict
at once: it already stands for a long silence), `success_threshold` successes mark
it up; a worker's first definite answer decides at once. `down_kind`
says why a down worker is down: the registry routes to workers that are down only
because their probes fail while they still answer (PANIC_KINDS) when a role has no
healthy worker left (Envoy's panic threshold). Pure state, no I/O: the HealthChecker
feeds it, tests drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from router.config import HealthConfig

ProbeKind = Literal["ok", "timeout", "refused", "reset", "status", "server_info"]
DownKind = Literal["refused", "reset", "status", "server_info", "unresponsive"]
Transition = Literal["up", "down"]

# Down by probes alone while the process still answers: worth routing to when nothing else is up.
PANIC_KINDS: frozenset[str] = frozenset({"status", "reset"})


@dataclass(frozen=True)
class ProbeOutcome:
    kind: ProbeKind
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.kind == "ok"


@dataclass
class HealthState:
    healthy: bool = False  # a new worker is routable after its first successful check
    checked: bool = False  # a definite answer (not a timeout) has been recorded
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    consecutive_timeouts: int = 0
    last_error: str | None = None
    down_kind: DownKind | None = None
    last_alive_at: float | None = None  # last probe answer or request progress (monotonic)
    first_probe_at: float | None = None
    last_verdict_at: float = float("-inf")
    load_penalty: int = 0  # added to the worker's in-flight count by the policies

    def record(
        self, outcome: ProbeOutcome, cfg: HealthConfig, *, now: float, progress_at: float | None = None
    ) -> Transition | None:
        """Apply one probe; returns the transition it caused, if any."""
        before = self.healthy
        progressed = progress_at is not None and progress_at > self.last_verdict_at
        self.last_verdict_at = now
        if self.first_probe_at is None:
            self.first_probe_at = now
        if progressed:
            assert progress_at is not None
            self.last_alive_at = max(self.last_alive_at or progress_at, progress_at)
        if outcome.ok:
            self.last_alive_at = now
            self.consecutive_timeouts = 0
        elif outcome.kind == "timeout":
            self.consecutive_timeouts += 1
        self.load_penalty = min(self.consecutive_timeouts, cfg.max_slow_probes) * cfg.slow_probe_load
        if outcome.ok or progressed:
            note = None if outcome.ok else f"{outcome.error} (ignored: the worker answered requests since)"
            self._success(note, cfg)
        elif outcome.kind == "timeout":
            since = self.last_alive_at if self.last_alive_at is not None else self.first_probe_at
            silent = now - since
            if silent >= cfg.unresponsive_after_s:
                self._failure("unresponsive", f"no answer to probes or requests for {silent:.1f}s "
                                              f"(last probe: {outcome.error})", cfg)
            else:
                self.last_error = f"{outcome.error} (slow, not down: answered {silent:.1f}s ago)"
        else:
            assert outcome.kind != "ok"
            self._failure(outcome.kind, outcome.error, cfg)
        if before == self.healthy:
            return None
        return "up" if self.healthy else "down"

    def _success(self, note: str | None, cfg: HealthConfig) -> None:
        self.consecutive_successes += 1
        self.consecutive_failures = 0
        self.last_error = note
        if not self.checked or self.consecutive_successes >= cfg.success_threshold:
            self.healthy = True
            self.down_kind = None
        self.checked = True

    def _failure(self, kind: DownKind, error: str | None, cfg: HealthConfig) -> None:
        self.consecutive_failures += 1
        self.consecutive_successes = 0
        self.last_error = error
        decisive = not self.checked or kind == "unresponsive"  # a long silence is its own evidence
        if decisive or self.consecutive_failures >= cfg.failure_threshold:
            self.healthy = False
            self.down_kind = kind
        self.checked = True

    @property
    def panic_routable(self) -> bool:
        """Down by probes alone while the worker still answers (see PANIC_KINDS)."""
        return self.checked and not self.healthy and self.down_kind in PANIC_KINDS
