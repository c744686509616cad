"""Engine liveness that never waits for a step: a step clock in shared memory.

    engine process                                   frontend process
    with stepping(clock): scheduler.step()           clock.read() -> StepSnapshot
      begin: steps += 1, started_at = now, in_step     idle, or in a step younger than
      end:   in_step = 0, last_step_s = duration       --watchdog-timeout  -> alive
                                                       a step older than that -> hung

The clock is a 64-byte file (mmap) next to the instance's ZMQ sockets, created by the
launcher before the engine starts and attached to by the engine. The frontend reads it
without any message to the engine, so GET /health answers in microseconds while a step
runs for seconds. Writes are guarded by a sequence counter (odd while a write is under
way); a reader retries a torn read a bounded number of times.

Times are time.monotonic() (CLOCK_MONOTONIC, one clock for every process of the machine).
A busy engine is alive; only a step that has run past --watchdog-timeout is a hung one,
and then the instance ends itself (tokenizer_manager.py: the watchdog).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # at run time this module needs only the standard library (the router imports it)
    from common.server.ipc import EngineIpcAddrs

# What the frontend promises about GET /health: it answers from the clock within this bound
# (it never waits on the engine). The router's probe timeout must be longer (router/config.py).
HEALTH_ANSWER_BOUND_S = 0.25

_LAYOUT = struct.Struct("<QQdQd")  # seq, steps, step_started_at, in_step, last_step_s
_SIZE = 64
_READ_TRIES = 100


@dataclass(frozen=True)
class StepSnapshot:
    steps: int  # steps begun since the engine started
    in_step: bool
    step_started_at: float  # monotonic start of the current (or last) step; 0.0 before the first
    last_step_s: float  # duration of the last finished step

    def step_age_s(self, now: float) -> float:
        """How long the current step has run (0.0 when idle)."""
        return max(0.0, now - self.step_started_at) if self.in_step else 0.0

    def describe(self, now: float) -> dict[str, float | int | bool]:
        return {
            "steps": self.steps,
            "in_step": self.in_step,
            "step_age_s": round(self.step_age_s(now), 3),
            "last_step_s": round(self.last_step_s, 3),
        }


IDLE_SNAPSHOT = StepSnapshot(0, False, 0.0, 0.0)


def step_clock_path(addrs: EngineIpcAddrs) -> str:
    """The clock file of the instance whose ZMQ sockets are `addrs` (same directory, same stem)."""
    return addrs.requests.removeprefix("ipc://") + ".clock"


class StepClock:
    """One instance's step clock; the engine writes it, the frontend reads it."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self._fd = fd
        self._map = mmap.mmap(fd, _SIZE)
        self._steps = 0
        self._started = 0.0
        self._last = 0.0
        self._seq = 0

    @classmethod
    def create(cls, path: str) -> StepClock:
        """A zeroed clock (the launcher, before the engine starts)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, _SIZE)
        return cls(path, fd)

    @classmethod
    def attach(cls, path: str) -> StepClock:
        """The clock the launcher created (the engine); creates it when run without a launcher."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if os.fstat(fd).st_size < _SIZE:
            os.ftruncate(fd, _SIZE)
        return cls(path, fd)

    # ---- engine side ---------------------------------------------------------------------------
    def step_begin(self) -> None:
        self._steps += 1
        self._started = time.monotonic()
        self._write(in_step=True)

    def step_end(self) -> None:
        self._last = time.monotonic() - self._started
        self._write(in_step=False)

    def _write(self, *, in_step: bool) -> None:
        self._seq += 1  # odd: a write is under way
        struct.pack_into("<Q", self._map, 0, self._seq)
        _LAYOUT.pack_into(self._map, 0, self._seq, self._steps, self._started, int(in_step), self._last)
        self._seq += 1
        struct.pack_into("<Q", self._map, 0, self._seq)

    # ---- frontend side -------------------------------------------------------------------------
    def read(self) -> StepSnapshot:
        """The latest consistent snapshot (after _READ_TRIES torn reads: the last one read)."""
        fields = _LAYOUT.unpack_from(self._map, 0)
        for _ in range(_READ_TRIES):
            seq = fields[0]
            again = _LAYOUT.unpack_from(self._map, 0)
            if seq % 2 == 0 and again == fields:
                break
            fields = again
        _, steps, started, in_step, last = fields
        return StepSnapshot(int(steps), bool(in_step), float(started), float(last))

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)

    def remove(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@contextmanager
def stepping(clock: StepClock | None) -> Iterator[None]:
    """Marks one scheduler step on the clock (no-op without a clock)."""
    if clock is None:
        yield
        return
    clock.step_begin()
    try:
        yield
    finally:
        clock.step_end()


def hung_reason(snap: StepSnapshot, now: float, watchdog_timeout: float) -> str | None:
    """Why the engine counts as hung (a step older than --watchdog-timeout), or None."""
    age = snap.step_age_s(now)
    if age <= watchdog_timeout:
        return None
    return (
        f"the engine is hung: step {snap.steps} has been running for {age:.2f}s, longer than "
        f"--watchdog-timeout {watchdog_timeout:g}s"
    )
