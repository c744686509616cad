"""A simulated device for the overlap loop on CPU: forwards that take D ms without the CPU.

    host (scheduler thread)                       device (its own clock, a thread for the tokens)
    launch(N): host work until H ms of this step  ─> step N occupies the device from
               have passed, then queue step N          max(launched, step N-1's end) for D ms;
                                                       a thread runs the inner worker meanwhile
    collect(N): wait for N's tokens, then sleep until N's end (the GIL released)

`SimulatedDeviceWorker` wraps a model worker (FakeModelWorker in tests: its tokens check the
bookkeeping, FutureMap placeholders included). H is the host's whole share of a step: the
scheduler's bookkeeping plus the launch, which busy-waits (holding the GIL, as Python host code
does) until H ms have passed since the previous collect returned. The device's clock runs
without the host, as a GPU runs its queue: its thread only computes the tokens (briefly holding
the GIL, any time before the step's end; collect computes them itself if the thread has not got
to them yet, keeping the order), so neither a late wake-up of that thread nor the GIL's switch
interval adds device time on a loaded box. With the normal loop a step takes H + D; with
the overlap loop (LaunchExecutor) max(H, D).

`timeline` records (what, step_id, perf_counter) for launch/collect/device start/end, so a
test can check the order of events rather than only the clock.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from common.scheduler.executor import ModelWorker, StepResult, WorkerBatch

COLLECT_TIMEOUT_S = 30.0


@dataclass
class SimStep:
    """A step queued on the simulated device; `finished` is its completion event."""

    batch: WorkerBatch
    launched: float
    end: float = 0.0  # when the device finishes the step (set when it is queued)
    finished: threading.Event = field(default_factory=threading.Event)  # the tokens are computed
    taken: threading.Lock = field(default_factory=threading.Lock)  # held by whoever computes them
    result: StepResult | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class SimEvent:
    what: str  # launch | collect | device_start | device_end
    step_id: int
    at: float


class SimulatedDeviceWorker:
    def __init__(self, inner: ModelWorker, *, host_s: float, device_s: float) -> None:
        self.inner = inner
        self.host_s = host_s
        self.device_s = device_s
        self.timeline: list[SimEvent] = []
        self._queue: queue.SimpleQueue[SimStep | None] = queue.SimpleQueue()
        self._host_since: float | None = None
        self._device_free_at = 0.0
        self._thread = threading.Thread(target=self._device_loop, name="sim-device", daemon=True)
        self._thread.start()

    @property
    def future_capacity(self) -> int:
        return self.inner.future_capacity

    def run(self, batch: WorkerBatch) -> StepResult:
        return self.collect(self.launch(batch))

    def launch(self, batch: WorkerBatch) -> SimStep:
        now = time.perf_counter()
        until = (self._host_since if self._host_since is not None else now) + self.host_s
        while time.perf_counter() < until:  # the host's share of the step, holding the GIL
            pass
        step = SimStep(batch=batch, launched=time.perf_counter())
        start = max(step.launched, self._device_free_at)
        step.end = self._device_free_at = start + self.device_s
        self.timeline.append(SimEvent("launch", batch.step_id, step.launched))
        self.timeline.append(SimEvent("device_start", batch.step_id, start))
        self._queue.put(step)
        return step

    def collect(self, step: SimStep) -> StepResult:
        if step.taken.acquire(blocking=False):  # the device thread has not got to it: compute here
            self._compute(step)
        elif not step.finished.wait(COLLECT_TIMEOUT_S):
            raise TimeoutError(f"simulated step {step.batch.step_id} did not finish in {COLLECT_TIMEOUT_S}s")
        delay = step.end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        self._host_since = time.perf_counter()
        self.timeline.append(SimEvent("collect", step.batch.step_id, self._host_since))
        if step.error is not None:
            raise step.error
        assert step.result is not None
        return step.result

    def _device_loop(self) -> None:
        """Computes queued steps in order; one collect took already is waited for, not skipped."""
        while True:
            step = self._queue.get()
            if step is None:
                return
            if step.taken.acquire(blocking=False):
                self._compute(step)
            else:
                step.finished.wait(COLLECT_TIMEOUT_S)

    def _compute(self, step: SimStep) -> None:
        try:
            step.result = self.inner.run(step.batch)
        except BaseException as e:
            step.error = e
        self.timeline.append(SimEvent("device_end", step.batch.step_id, step.end))
        step.finished.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
