"""Engine liveness that never waits for a step: a step clock in shared memory.

    engine process                                   frontend process
    with busy(clock, phase): <one part of the loop>  clock.read() -> StepSnapshot
      begin: phase = code, started_at = now            idle, or in a phase younger than
             (phase "step": steps += 1)                --watchdog-timeout  -> alive
      end:   phase = 0 (a step: last_step_s)           a phase older than that -> hung

Everything the engine thread does between two waits for input is a phase (PHASES: the
scheduler step, the transfer poll, bootstrap handling, request intake, output flush, idle
checks), so a hang anywhere in it, not only in a forward step, is seen and named.

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
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # at run time this module needs only the standard library (the router imports it)
    from common.server.ipc import EngineIpcAddrs

# What the frontend promises about GET /health: it answers from the clock within this bound
# (it never waits on the engine). The router's probe timeout must be longer (router/config.py).
HEALTH_ANSWER_BOUND_S = 0.25

_LAYOUT = struct.Struct("<QQdQd")  # seq, steps, started_at, phase (0: idle), last_step_s
PHASES = ("idle", "step", "transfer poll", "bootstrap handling", "request intake", "output flush", "idle checks")
_SIZE = 64
_READ_TRIES = 100


@dataclass(frozen=True)
class StepSnapshot:
    steps: int  # steps begun since the engine started
    in_step: bool
    step_started_at: float  # monotonic start of the current (or last) step; 0.0 before the first
    last_step_s: float  # duration of the last finished step
    phase: str = "step"  # what the engine thread is in while in_step (PHASES)

    def step_age_s(self, now: float) -> float:
        """How long the current step has run (0.0 when idle)."""
        return max(0.0, now - self.step_started_at) if self.in_step else 0.0

    def describe(self, now: float) -> dict[str, float | int | bool | str]:
        out: dict[str, float | int | bool | str] = {
            "steps": self.steps,
            "in_step": self.in_step,
            "step_age_s": round(self.step_age_s(now), 3),
            "last_step_s": round(self.last_step_s, 3),
        }
        if self.in_step:
            out["phase"] = self.phase
        return out


IDLE_SNAPSHOT = StepSnapshot(0, False, 0.0, 0.0, "idle")


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
        self._step_started = 0.0
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
        self.busy_begin(1)

    def step_end(self) -> None:
        self.busy_end(1)

    def busy_begin(self, phase: int) -> None:
        """The engine thread enters PHASES[phase] (1: a scheduler step)."""
        self._started = time.monotonic()
        if phase == 1:
            self._steps += 1
            self._step_started = self._started
        self._write(phase)

    def busy_end(self, phase: int) -> None:
        if phase == 1:
            self._last = time.monotonic() - self._step_started
        self._write(0)

    def _write(self, phase: int) -> None:
        self._seq += 1  # odd: a write is under way
        struct.pack_into("<Q", self._map, 0, self._seq)
        _LAYOUT.pack_into(self._map, 0, self._seq, self._steps, self._started, phase, self._last)
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
        _, steps, started, phase, last = fields
        name = PHASES[phase] if phase < len(PHASES) else "step"
        return StepSnapshot(int(steps), bool(phase), float(started), float(last), name)

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
def busy(clock: StepClock | None, phase: str) -> Iterator[None]:
    """Marks one part of the engine loop (a name in PHASES) on the clock (no-op without a clock)."""
    if clock is None:
        yield
        return
    code = PHASES.index(phase)
    clock.busy_begin(code)
    try:
        yield
    finally:
        clock.busy_end(code)


def stepping(clock: StepClock | None) -> AbstractContextManager[None]:
    """Marks one scheduler step on the clock (no-op without a clock)."""
    return busy(clock, "step")


def hung_reason(snap: StepSnapshot, now: float, watchdog_timeout: float) -> str | None:
    """Why the engine counts as hung (a phase older than --watchdog-timeout), or None."""
    age = snap.step_age_s(now)
    if age <= watchdog_timeout:
        return None
    if snap.phase != "step":
        return (f"the engine is hung in its {snap.phase}: running for {age:.2f}s, longer than "
                f"--watchdog-timeout {watchdog_timeout:g}s")
    return (
        f"the engine is hung: step {snap.steps} has been running for {age:.2f}s, longer than "
        f"--watchdog-timeout {watchdog_timeout:g}s"
    )
