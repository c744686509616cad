"""Test-only fault hook: the engine's forward step really takes N seconds, or never ends.

    --engine-fault-spec "slow_step_s=10,after_steps=2"     forwards 3, 4, ... each take 10 s longer
    --engine-fault-spec "slow_step_s=10,after_steps=2,steps=1"   only forward 3 is slow
    --engine-fault-spec "hang,after_steps=1"               forward 2 never returns
    --engine-fault-spec "hang,at=transfer_poll"            the first transfer poll with work never returns
    --engine-fault-spec "hang,at=bootstrap"                handling the first request with bootstrap info hangs

`at` (default forward) picks where the fault acts and what after_steps/steps count: forwards,
transfer polls while the scheduler has work (engine_core.py), or requests that carry bootstrap
info as the engine thread takes them in (engine_process.py).

The engine process installs the parsed spec once (`install`, from engine_handle.py);
the model worker calls `before_forward()` at the start of every forward
(common/scheduler/model_worker.py). Without a spec that is one global lookup.
Used by the liveness tests: a busy engine must stay healthy, a hung one must be
caught by the watchdog.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_KEYS = ("slow_step_s", "after_steps", "steps", "at")
PLACES = ("forward", "transfer_poll", "bootstrap")


@dataclass
class StepFault:
    after_steps: int = 0  # forwards that run normally first
    slow_step_s: float = 0.0  # extra seconds each faulty forward takes
    steps: int | None = None  # faulty forwards (None: every later one)
    hang: bool = False  # the first faulty forward never returns
    at: str = "forward"  # where it acts (PLACES)
    seen: int = 0

    @classmethod
    def parse(cls, spec: str) -> StepFault:
        """`key=value,...` (keys: slow_step_s, after_steps, steps) plus the flag `hang`; ValueError if bad."""
        fault = cls()
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            if item == "hang":
                fault.hang = True
                continue
            key, sep, value = item.partition("=")
            if not sep or key not in _KEYS:
                raise ValueError(f"engine fault spec {spec!r}: unknown item {item!r} (use hang, {', '.join(_KEYS)})")
            try:
                if key == "at":
                    if value not in PLACES:
                        raise ValueError
                    fault.at = value
                elif key == "slow_step_s":
                    fault.slow_step_s = float(value)
                elif key == "after_steps":
                    fault.after_steps = int(value)
                else:
                    fault.steps = int(value)
            except ValueError:
                raise ValueError(f"engine fault spec {spec!r}: {key} needs "
                                 f"{'one of ' + ', '.join(PLACES) if key == 'at' else 'a number'}, got {value!r}") from None
        if fault.hang == (fault.slow_step_s > 0):
            raise ValueError(f"engine fault spec {spec!r}: give exactly one of hang or slow_step_s > 0")
        if fault.after_steps < 0 or (fault.steps is not None and fault.steps < 1):
            raise ValueError(f"engine fault spec {spec!r}: after_steps must be >= 0 and steps >= 1")
        return fault

    def before_forward(self) -> None:
        self.seen += 1
        k = self.seen - self.after_steps  # 1 for the first faulty forward
        if k < 1 or (self.steps is not None and k > self.steps):
            return
        if self.hang:
            logger.warning("engine fault: %s %d hangs forever", self.at, self.seen)
            threading.Event().wait()
        logger.warning("engine fault: %s %d takes %gs longer", self.at, self.seen, self.slow_step_s)
        time.sleep(self.slow_step_s)


_installed: StepFault | None = None


def install(spec: str | None) -> None:
    """Arm the hook for this process (None: disarm)."""
    global _installed
    _installed = StepFault.parse(spec) if spec else None


def before_forward() -> None:
    if _installed is not None and _installed.at == "forward":
        _installed.before_forward()


def at_point(place: str) -> None:
    """The engine thread reached `place` (PLACES, not forward): act if the spec says so."""
    if _installed is not None and _installed.at == place:
        _installed.before_forward()
