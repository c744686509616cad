"""DeviceStreams on a GPU (device_streams.py): pinned staging, a worker stream, events.

    scheduler thread (default stream)        worker thread (worker stream)
    ─ req_to_token zeroing, KV restore ──┐
                                         └──> wait_stream(default)   start of each step
                                              staged inputs: pinned host -> device, async
                                              forward + sample
                                              record(): step event   (prefill sends wait on it)
                                              tokens -> pinned host, async; event; synchronize
    wait_stream(worker) <─ before the scheduler touches device memory the worker may use

Pinned buffers come from torch's caching host allocator, which holds each block until the
copies queued from it have run, so a buffer is never refilled under a copy in flight.
Only imported when the device is a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.model.device_streams import DeviceStreams, StepEvent, Values


class CudaStreams(DeviceStreams):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.worker_stream = torch.cuda.Stream(device=device)
        self.scheduler_stream = torch.cuda.default_stream(device)

    def stage(self, lists: Sequence[Values], dtype: torch.dtype) -> list[torch.Tensor]:
        if not lists:
            return []
        sizes = [len(x) for x in lists]
        flat = [v for x in lists for v in x]
        staged = torch.tensor(flat, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)
        return list(staged.split(sizes))

    def host(self, values: Values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(list(values), dtype=dtype, pin_memory=True)

    def record(self) -> StepEvent:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def fetch(self, tensors: Sequence[torch.Tensor]) -> list[list]:  # type: ignore[type-arg]
        hosts = []
        for t in tensors:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            hosts.append(h)
        self.record().synchronize()
        return [h.tolist() for h in hosts]

    def enter_worker(self) -> None:
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.worker_stream)

    def worker_waits_for_scheduler(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.scheduler_stream)

    def scheduler_waits_for_worker(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.worker_stream)
