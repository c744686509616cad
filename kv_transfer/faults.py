"""Fault injection for the NIXL path (tests and the reliability suite).

Spec string, comma separated `key=value` (all optional):

    fail_post=P        each post raises with probability P
    fail_post_nth=N    the N-th post (1-based, counted per manager) raises
    fail_poll=P        each check of a posted transfer raises with probability P
    drop_status=P      each Status message prefill sends is dropped with probability P
    drop_status_nth=N  the N-th Status message is dropped
    delay_ms=D         every post sleeps D ms first (in the manager thread)
    stall_s=S          the manager thread's next loop iteration sleeps S s (once): a stuck thread
    stall_file=PATH    the manager thread sleeps while PATH exists (at most STALL_FILE_MAX_S): a
                       stuck thread for exactly as long as the test needs, whatever the load
    crash_after_s=T    the manager thread dies T s after the spec took effect (uncaught error)
    hold_file=PATH     while PATH exists, no posted transfer reads as done (a stalled link; the
                       manager thread stays responsive, so heartbeats and status go on)
    seed=S             RNG seed (default 0)
    rank=R             TP rank whose agent fail_post, fail_post_nth, fail_poll and delay_ms hit
                       (default 0; the other keys act on rank 0's manager)

Example: "fail_post=0.1,fail_poll=0.05,drop_status=0.1,delay_ms=50,seed=1".
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, fields

STALL_FILE_MAX_S = 60.0  # a test that died without removing its stall file does not hang the thread


class InjectedFault(RuntimeError):
    pass


class InjectedCrash(RuntimeError):
    """Raised outside every guard of the manager thread: it dies as a bug would kill it."""


@dataclass(frozen=True)
class FaultSpec:
    fail_post: float = 0.0
    fail_post_nth: int = 0
    fail_poll: float = 0.0
    drop_status: float = 0.0
    drop_status_nth: int = 0
    delay_ms: float = 0.0
    stall_s: float = 0.0
    crash_after_s: float = 0.0
    hold_file: str = ""
    stall_file: str = ""
    seed: int = 0
    rank: int = 0

    @classmethod
    def parse(cls, spec: str) -> FaultSpec:
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, float | int | str] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in known:
                raise ValueError(f"bad fault spec item {item!r}; known keys: {sorted(known)}")
            if known[key] in (str, "str"):
                values[key] = raw.strip()
                continue
            try:
                values[key] = int(raw) if known[key] in (int, "int") else float(raw)
            except ValueError:
                raise ValueError(f"bad value in fault spec item {item!r}") from None
        return cls(**values)  # type: ignore[arg-type]

    @property
    def active(self) -> bool:
        return self != FaultSpec(seed=self.seed, rank=self.rank)


class FaultInjector:
    """Called by the NIXL endpoint and the prefill side at each injection point."""

    def __init__(self, spec: FaultSpec, rank: int = 0) -> None:
        self.rank = rank  # this agent's TP rank: post/poll faults hit only spec.rank's
        self.spec = spec
        self._rng = random.Random(spec.seed)
        self._posts = 0
        self._statuses = 0
        self._since = time.monotonic()
        self._stalled = False
        self.injected: dict[str, int] = {}

    def reconfigure(self, spec: FaultSpec) -> None:
        """Swap the spec at run time (tests, reliability suite); counters restart."""
        self.spec = spec
        self._rng = random.Random(spec.seed)
        self._posts = self._statuses = 0
        self._since = time.monotonic()
        self._stalled = False

    def _hit(self, what: str) -> None:
        self.injected[what] = self.injected.get(what, 0) + 1

    def in_loop(self) -> None:
        """Top of every manager-thread iteration."""
        if self.spec.stall_s > 0 and not self._stalled:
            self._stalled = True
            self._hit("stall")
            time.sleep(self.spec.stall_s)
        if self.spec.stall_file and os.path.exists(self.spec.stall_file):
            self._hit("stall")
            deadline = time.monotonic() + STALL_FILE_MAX_S
            while os.path.exists(self.spec.stall_file) and time.monotonic() < deadline:
                time.sleep(0.01)
        if self.spec.crash_after_s > 0 and time.monotonic() - self._since >= self.spec.crash_after_s:
            self._hit("crash")
            raise InjectedCrash(f"injected crash of the kv_transfer thread after {self.spec.crash_after_s:g}s")

    def before_post(self) -> None:
        if self.spec.rank != self.rank:
            return
        self._posts += 1
        if self.spec.delay_ms > 0:
            time.sleep(self.spec.delay_ms / 1000.0)
        if self._posts == self.spec.fail_post_nth or self._rng.random() < self.spec.fail_post:
            self._hit("fail_post")
            raise InjectedFault(f"injected post failure (post #{self._posts})")

    def at_poll(self) -> None:
        if self.spec.rank != self.rank:
            return
        if self.spec.fail_poll > 0 and self._rng.random() < self.spec.fail_poll:
            self._hit("fail_poll")
            raise InjectedFault("injected poll failure")

    def holding(self) -> bool:
        """True while the hold file exists: a posted transfer must not read as done."""
        if self.spec.hold_file and os.path.exists(self.spec.hold_file):
            self._hit("hold")
            return True
        return False

    def drop_status(self) -> bool:
        self._statuses += 1
        if self._statuses == self.spec.drop_status_nth or self._rng.random() < self.spec.drop_status:
            self._hit("drop_status")
            return True
        return False
