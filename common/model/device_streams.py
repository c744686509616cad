"""How the model worker moves data between host and device, and orders its work.

One interface, two implementations:

    HostStreams (CPU)     kernels run synchronously: staging is torch.tensor, events are
                          complete once recorded, fetching is tolist
    CudaStreams (CUDA)    cuda_streams.py, imported only when the device is a GPU: pinned
                          staging buffers + non_blocking copies, the worker on its own
                          stream, results through an event-backed device -> host copy

A step of the worker, in this vocabulary:

    worker_waits_for_scheduler()      scheduler-side writes (req_to_token zeroing, restored KV)
    stage(lists) -> device tensors    one host buffer per dtype, one async copy each
    ... forward + sample, queued ...
    record() -> StepEvent             completion of the step's KV writes (prefill sends wait on it)
    start_fetch(tensors) -> HostCopy  the copy of the tokens to host memory, queued (no wait)
    HostCopy.wait() -> lists          THE host sync of a step: the tokens to stream

The overlap loop launches step N+1 (everything up to start_fetch) before it waits on step N's
HostCopy, so the device never idles on the host's bookkeeping.

Anything else that reads device memory on the host, or copies pageable host memory to the
device, stalls the host until the device drains (tests/model/test_host_syncs.py counts them).
Work the scheduler thread puts on the device calls scheduler_waits_for_worker() first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import torch


class StepEvent(Protocol):
    """Marks a point in the worker's queue of device work."""

    def query(self) -> bool:
        """True once all work queued before the event has finished (never blocks)."""
        ...

    def synchronize(self) -> None:
        """Block until query() is True."""
        ...


class ReadyEvent:
    """The event of a device whose work is done when it is queued (CPU)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


READY = ReadyEvent()

Values = Sequence[int] | Sequence[float] | Sequence[bool]


class HostCopy(Protocol):
    """Device tensors on their way to host memory; wait() is the one host sync of a step."""

    def wait(self) -> list[list]:  # type: ignore[type-arg]
        """Block until the copies are done; the tensors as Python lists, in order."""
        ...


class ReadyCopy:
    """CPU: the tensors already are in host memory; a snapshot now (a later launch may reuse
    their storage before this step is collected), converted to lists by wait()."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = [t.detach().clone() for t in tensors]

    def wait(self) -> list[list]:  # type: ignore[type-arg]
        return [t.tolist() for t in self.tensors]


class DeviceStreams(ABC):
    def __init__(self, device: torch.device) -> None:
        self.device = device

    @abstractmethod
    def stage(self, lists: Sequence[Values], dtype: torch.dtype) -> list[torch.Tensor]:
        """Each list as a 1-D device tensor of `dtype`, without blocking the host."""

    def stage_one(self, values: Values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return self.stage([values], dtype)[0]

    @abstractmethod
    def host(self, values: Values, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor that the device can copy from asynchronously (pinned on CUDA)."""

    @abstractmethod
    def record(self) -> StepEvent:
        """An event after everything the worker has queued so far."""

    @abstractmethod
    def start_fetch(self, tensors: Sequence[torch.Tensor]) -> HostCopy:
        """Queue one async device -> host copy per tensor and an event after them; no wait.
        The copy owns its host buffers until wait() returns (the overlap loop waits on step N
        after it has launched step N+1, so two copies may be in flight)."""

    def fetch(self, tensors: Sequence[torch.Tensor]) -> list[list]:  # type: ignore[type-arg]
        """Python lists of device tensors: start_fetch(tensors).wait()."""
        return self.start_fetch(tensors).wait()

    @abstractmethod
    def enter_worker(self) -> None:
        """Called on the worker thread before its first step (its device and stream)."""

    @abstractmethod
    def worker_waits_for_scheduler(self) -> None:
        """Start of a step: order it after device work the scheduler thread has queued."""

    @abstractmethod
    def scheduler_waits_for_worker(self) -> None:
        """Before the scheduler thread writes or reads device memory the worker may use."""


class HostStreams(DeviceStreams):
    """CPU: every op has finished when it returns, so nothing needs ordering."""

    def stage(self, lists: Sequence[Values], dtype: torch.dtype) -> list[torch.Tensor]:
        if self.device.type == "cpu":
            return [torch.tensor(list(x), dtype=dtype) for x in lists]
        return [torch.tensor(list(x), dtype=dtype, device=self.device) for x in lists]

    def host(self, values: Values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(list(values), dtype=dtype)

    def record(self) -> StepEvent:
        return READY

    def start_fetch(self, tensors: Sequence[torch.Tensor]) -> HostCopy:
        return ReadyCopy(tensors)

    def enter_worker(self) -> None:
        pass

    def worker_waits_for_scheduler(self) -> None:
        pass

    def scheduler_waits_for_worker(self) -> None:
        pass


def make_device_streams(device: torch.device | str) -> DeviceStreams:
    """HostStreams on CPU, CudaStreams (its own worker stream) on a GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        from common.model.cuda_streams import CudaStreams

        return CudaStreams(device)
    return HostStreams(device)
