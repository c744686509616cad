"""The seam between the scheduler (CPU bookkeeping) and the model worker (forward + sample).

    scheduler ──WorkerBatch──> executor.submit() ──> StepHandle.result() -> StepResult

`SyncExecutor` runs the worker inline (normal loop). `ThreadExecutor` runs it on one
worker thread fed by a FIFO (overlap loop on CPU: torch releases the GIL inside
its kernels, so the scheduler prepares step N+1 while step N computes). On CUDA
the same thread issues kernels on its own stream; ordering is the FIFO's.

FutureMap: every request in a step gets a future index; the worker stores the
token it samples there. A later step that needs that token before the scheduler
has seen it carries the placeholder -(index + 1) as input id, and the worker
resolves it. Because steps run strictly in FIFO order, the value is always there.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from common.model.device_streams import READY, StepEvent
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


class ModelWorker(Protocol):
    """Owns the device state: model, KV tensors, req_to_token table, future tokens."""

    def run(self, batch: WorkerBatch) -> StepResult: ...

    @property
    def future_capacity(self) -> int: ...


class StepHandle(Protocol):
    def result(self, timeout: float | None = None) -> StepResult: ...

    def done(self) -> bool: ...


class Executor(Protocol):
    def submit(self, batch: WorkerBatch) -> StepHandle: ...

    def shutdown(self) -> None: ...


class SyncExecutor:
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


class ThreadExecutor:
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
