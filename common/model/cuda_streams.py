"""DeviceStreams on a GPU (device_streams.py): pinned staging, a worker stream, events.

    scheduler thread (default stream)        worker thread (worker stream)
    ─ req_to_token zeroing, KV restore ──┐
                                         └──> wait_stream(default)   start of each step
                                              staged inputs: pinned host -> device, async
                                              forward + sample
                                              record(): step event   (prefill sends wait on it)
                                              tokens -> pinned host, async; event (start_fetch)
                                              ... step N+1 launched ...
                                              HostCopy.wait(): synchronize step N's event
    wait_stream(worker) <─ before the scheduler touches device memory the worker may use

Staging buffers come from torch's caching host allocator, which holds each block until the
copies queued from it have run, so a buffer is never refilled under a copy in flight. The
fetched tokens land in a ring of pinned buffers reused step after step (FetchRing): a slot is
taken again only after its copy's event, and its reader is told if it waited too late.
Only imported when the device is a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.model.device_streams import DeviceStreams, HostCopy, StepEvent, Values

FETCH_SLOTS = 3  # the overlap loop has at most two steps' copies in flight


class _FetchSlot:
    def __init__(self) -> None:
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.event: torch.cuda.Event | None = None
        self.owner: object = None

    def buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        buf = self.buffers.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 2 * (buf.numel() if buf is not None else 256)), dtype=dtype, pin_memory=True)
            self.buffers[dtype] = buf
        return buf


class CudaCopy:
    """A step's tokens on their way to a FetchRing slot."""

    def __init__(self, slot: _FetchSlot, hosts: list[torch.Tensor], event: torch.cuda.Event) -> None:
        self._slot, self._hosts, self._event = slot, hosts, event

    def wait(self) -> list[list]:  # type: ignore[type-arg]
        if self._slot.owner is not self:
            raise RuntimeError(f"a fetch waited on after {FETCH_SLOTS} newer ones reused its pinned buffer")
        self._event.synchronize()
        return [h.tolist() for h in self._hosts]


class FetchRing:
    """FETCH_SLOTS sets of pinned buffers, one set per start_fetch, round robin (no per-step
    pinned allocations once the buffers have grown to the largest batch)."""

    def __init__(self) -> None:
        self._slots = [_FetchSlot() for _ in range(FETCH_SLOTS)]
        self._next = 0

    def start(self, tensors: Sequence[torch.Tensor], stream: torch.cuda.Stream) -> CudaCopy:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % FETCH_SLOTS
        if slot.event is not None:
            slot.event.synchronize()  # done long ago in the overlap loop; guards other callers
        used: dict[torch.dtype, int] = {}
        for t in tensors:
            used[t.dtype] = used.get(t.dtype, 0) + t.numel()
        flat = {dtype: slot.buffer(dtype, n) for dtype, n in used.items()}
        offset = dict.fromkeys(used, 0)
        hosts = []
        for t in tensors:
            at = offset[t.dtype]
            h = flat[t.dtype][at : at + t.numel()].view(t.shape)
            offset[t.dtype] = at + t.numel()
            h.copy_(t, non_blocking=True)
            hosts.append(h)
        event = torch.cuda.Event()
        event.record(stream)
        slot.event = event
        copy = CudaCopy(slot, hosts, event)
        slot.owner = copy
        return copy


class CudaStreams(DeviceStreams):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.worker_stream = torch.cuda.Stream(device=device)
        self.scheduler_stream = torch.cuda.default_stream(device)
        self._fetch_ring = FetchRing()

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

    def start_fetch(self, tensors: Sequence[torch.Tensor]) -> HostCopy:
        return self._fetch_ring.start(tensors, torch.cuda.current_stream(self.device))

    def enter_worker(self) -> None:
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.worker_stream)

    def worker_waits_for_scheduler(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.scheduler_stream)

    def scheduler_waits_for_worker(self) -> None:
        torch.cuda.current_stream(self.device).wait_stream(self.worker_stream)
