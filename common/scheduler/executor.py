"""The seam between the scheduler (CPU bookkeeping) and the model worker (forward + sample).

    scheduler ──WorkerBatch──> executor.submit() ──> StepHandle.result() -> StepResult

A worker step has two halves: launch (queue the forward and sampling on the device, start the
copy of the sampled tokens to host memory) and collect (wait for that copy: the step's one
host sync). The executors:

    SyncExecutor     launch + collect inside submit()              the normal loop
    LaunchExecutor   launch inside submit(), collect in result()   the overlap loop on a device
                     one thread: schedule N+1, launch N+1, then collect N, so the device
                     runs step N while the host prepares N+1 (CUDA: kernels are async)
    ThreadExecutor   launch + collect on a second thread, FIFO     the overlap loop on CPU,
                     where launch IS the compute (torch releases the GIL inside its kernels)

FutureMap: every request in a step gets a future index; the worker stores the
token it samples there. A later step that needs that token before the scheduler
has seen it carries the placeholder -(index + 1) as input id, and the worker
resolves it. Because steps are launched strictly in order on one device queue, the value is
always there when the step that reads it runs.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from common.grammar.mask import StepGrammarMask
from common.model.device_streams import READY, HostCopy, StepEvent
from common.model.forward_batch import ForwardMode
from common.sampling_params import SamplingParams
from common.scheduler.kv_manager import SlotWrite

PromptLogprobs = tuple[list[float], list[list[tuple[int, float]]] | None]


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    row: int  # request row (sampler penalty state is keyed by it)
    step: int  # output tokens generated before this one (seeded sampling uses it)
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Set on a request's first step in this row: the worker resets the row's penalty state
    # to these prompt/output tokens before sampling.
    reset_prompt: list[int] | None = None
    reset_outputs: list[int] | None = None
    # Prompt logprobs (only requests that ask): the logits at step positions offset, offset+1, ...
    # score these prompt token ids (the worker then computes every position's logits for the step).
    prompt_logprob_offset: int = 0
    prompt_logprob_targets: list[int] | None = None


@dataclass
class WorkerBatch:
    """Only what the forward and the sampler need (no Req objects cross this line)."""

    mode: ForwardMode
    input_ids: list[int]  # negative = FutureMap placeholder
    positions: list[int]
    out_cache_loc: list[int]
    req_pool_indices: list[int]
    seq_lens: list[int]
    prefix_lens: list[int]
    sampling: list[SamplingRow]
    future_indices: list[int]  # where each request's sampled token is stored
    samples: list[bool] = field(default_factory=list)  # False: a non-final prompt chunk, no token kept
    slot_writes: list[SlotWrite] = field(default_factory=list)
    step_id: int = 0
    # structured output: applied to the sampled rows' logits before sampling (rank 0 only: TP
    # followers sample unmasked and take rank 0's tokens); never sent over the wire
    grammar_mask: StepGrammarMask | None = None

    def extend_lens_cumsum(self) -> list[int]:
        """End (exclusive) of each request's tokens in input_ids."""
        ends, total = [], 0
        for seq_len, prefix_len in zip(self.seq_lens, self.prefix_lens, strict=True):
            total += seq_len - prefix_len
            ends.append(total)
        return ends


@dataclass
class StepResult:
    next_token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    forward_seconds: float = 0.0
    # per request of the step: (logprob of each target, top logprobs per target or None), or None
    prompt_logprobs: list[PromptLogprobs | None] | None = None
    # Completes when the step's device work (its KV writes included) has finished. A step that
    # samples nothing returns before that: whatever reads its KV (a KV send) waits on this.
    done: StepEvent = READY


@dataclass
class LaunchedStep:
    """A step the TorchModelWorker has launched and not yet collected (owned by the executor
    until collect)."""

    batch: WorkerBatch
    keep: list[int]  # the requests whose token is sampled
    start: float  # perf_counter at launch
    done: StepEvent = READY
    prompt_logprobs: list[PromptLogprobs | None] | None = None
    copy: HostCopy | None = None  # the sampled tokens (+ logprobs) on their way to the host
    has_logprobs: bool = False
    has_top: bool = False
    launch_seconds: float = 0.0


class ModelWorker(Protocol):
    """Owns the device state: model, KV tensors, req_to_token table, future tokens."""

    def run(self, batch: WorkerBatch) -> StepResult: ...

    @property
    def future_capacity(self) -> int: ...


L = TypeVar("L")


class SplitWorker(ModelWorker, Protocol[L]):
    """A worker whose step splits into launch (no host wait) and collect (the one wait)."""

    def launch(self, batch: WorkerBatch) -> L: ...

    def collect(self, launched: L) -> StepResult: ...


class StepHandle(Protocol):
    def result(self, timeout: float | None = None) -> StepResult: ...

    def done(self) -> bool: ...


class Executor(Protocol):
    # True when steps run on a thread of their own: a step may then wait inside the worker for
    # the scheduler (its grammar mask), which processes the step before it meanwhile
    worker_thread: bool

    def submit(self, batch: WorkerBatch) -> StepHandle: ...

    def shutdown(self) -> None: ...


class SyncExecutor:
    worker_thread = False

    def __init__(self, worker: ModelWorker) -> None:
        self.worker = worker

    def submit(self, batch: WorkerBatch) -> StepHandle:
        fut: Future[StepResult] = Future()
        try:
            fut.set_result(self.worker.run(batch))
        except BaseException as e:  # surfaced by result()
            fut.set_exception(e)
        return fut

    def shutdown(self) -> None:
        pass


class LaunchedHandle(Generic[L]):
    """Step N's handle in the one-thread overlap loop: result() collects it (once)."""

    def __init__(self, worker: SplitWorker[L], launched: L) -> None:
        self._worker = worker
        self._launched = launched
        self._fut: Future[StepResult] = Future()

    def result(self, timeout: float | None = None) -> StepResult:
        if not self._fut.done():
            try:
                self._fut.set_result(self._worker.collect(self._launched))
            except BaseException as e:
                self._fut.set_exception(e)
        return self._fut.result(timeout)

    def done(self) -> bool:
        return self._fut.done()


class LaunchExecutor(Generic[L]):
    """The overlap loop on one thread: submit() launches, result() collects. The scheduler
    submits step N+1 before it reads step N's result, so N+1 is queued on the device while N
    runs. on_thread_start (the worker's device and stream) runs once on each thread that submits
    (one at a time: the scheduler is not thread-safe)."""

    worker_thread = False

    def __init__(self, worker: SplitWorker[L], *, on_thread_start: Callable[[], None] | None = None) -> None:
        self.worker = worker
        self._on_start = on_thread_start
        self._threads: set[int] = set()

    def submit(self, batch: WorkerBatch) -> StepHandle:
        if threading.get_ident() not in self._threads:
            self._threads.add(threading.get_ident())
            if self._on_start is not None:
                self._on_start()
        try:
            launched = self.worker.launch(batch)
        except BaseException as e:  # surfaced by result(), as the other executors do
            failed: Future[StepResult] = Future()
            failed.set_exception(e)
            return failed
        return LaunchedHandle(self.worker, launched)

    def shutdown(self) -> None:
        pass


class ThreadExecutor:
    worker_thread = True

    def __init__(self, worker: ModelWorker, *, on_thread_start: Callable[[], None] | None = None) -> None:
        self.worker = worker
        self._queue: queue.SimpleQueue[tuple[WorkerBatch, Future[StepResult]] | None] = queue.SimpleQueue()
        self._on_start = on_thread_start
        self._thread = threading.Thread(target=self._loop, name="model-worker", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self._on_start is not None:
            self._on_start()
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(self.worker.run(batch))
            except BaseException as e:
                fut.set_exception(e)

    def submit(self, batch: WorkerBatch) -> StepHandle:
        fut: Future[StepResult] = Future()
        self._queue.put((batch, fut))
        return fut

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)


class FutureIndexAllocator:
    """Hands out future indices round robin; capacity must exceed the tokens of two steps."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._next = 0

    def take(self, n: int) -> list[int]:
        out = [(self._next + i) % self.capacity for i in range(n)]
        self._next = (self._next + n) % self.capacity
        return out


def placeholder(future_index: int) -> int:
    return -(future_index + 1)


def future_index_of(placeholder_id: int) -> int:
    return -placeholder_id - 1
