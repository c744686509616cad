"""A simulated device for the overlap loop on CPU: forwards that take D ms without the CPU.

    host (scheduler thread)                       device (one thread, FIFO)
    launch(N): host work until H ms of this step  ─> queue: step N "runs" from
               have passed, then queue step N           max(launched, step N-1 ended) for D ms
    collect(N): wait for N's end  <──────────────── runs the inner worker, sleeps to the end, signals

`SimulatedDeviceWorker` wraps a model worker (FakeModelWorker in tests: its tokens check the
bookkeeping, FutureMap placeholders included). H is the host's whole share of a step: the
scheduler's bookkeeping plus the launch, which busy-waits (holding the GIL, as Python host code
does) until H ms have passed since the previous collect returned. The device's clock starts when
a step could start, so a late wake-up of its thread (the GIL, a loaded box) does not add device
time: a GPU runs its queue without the host. With the normal loop a step takes H + D; with
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
    finished: threading.Event = field(default_factory=threading.Event)
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
        self.timeline.append(SimEvent("launch", batch.step_id, step.launched))
        self._queue.put(step)
        return step

    def collect(self, step: SimStep) -> StepResult:
        if not step.finished.wait(COLLECT_TIMEOUT_S):
            raise TimeoutError(f"simulated step {step.batch.step_id} did not finish in {COLLECT_TIMEOUT_S}s")
        self._host_since = time.perf_counter()
        self.timeline.append(SimEvent("collect", step.batch.step_id, self._host_since))
        if step.error is not None:
            raise step.error
        assert step.result is not None
        return step.result

    def _device_loop(self) -> None:
        while True:
            step = self._queue.get()
            if step is None:
                return
            start = max(step.launched, self._device_free_at)
            end = start + self.device_s
            self._device_free_at = end
            self.timeline.append(SimEvent("device_start", step.batch.step_id, start))
            try:
                step.result = self.inner.run(step.batch)
            except BaseException as e:
                step.error = e
            delay = end - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            self.timeline.append(SimEvent("device_end", step.batch.step_id, end))
            step.finished.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
