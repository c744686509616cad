"""HostSyncCounter: counts, on any device, the calls that would make the host wait for a GPU.

    with HostSyncCounter() as c:
        scheduler.step()
    c.fetches   # HostCopy.wait calls (DeviceStreams.fetch / start_fetch): the step's one budgeted sync
    c.syncs     # everything else that reads device memory on the host or copies pageable
                # host memory to the device, as {"Tensor.tolist": n, ...}

Counted (outside fetch): Tensor.item / tolist / cpu / numpy / nonzero, bool() / int() /
float() of a tensor, torch.nonzero, repeat_interleave without output_size (its output size is
read back), torch.tensor / torch.as_tensor given a device (pageable host -> device), and
Tensor.to(device) from an unpinned tensor. On CPU nothing really waits, so this is how a CPU
test keeps a GPU's step free of syncs: every host -> device copy must go through
DeviceStreams.stage, and every device -> host read through DeviceStreams.start_fetch + wait.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from common.model.device_streams import ReadyCopy

TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__")


class HostSyncCounter:
    def __init__(self, exempt: Sequence[tuple[type, str]] = ()) -> None:
        """exempt: (class, method) whose calls are not looked into (a device library's CPU
        stand-in: the real one runs kernels)."""
        self.syncs: Counter[str] = Counter()
        self.fetches = 0
        self._inside = threading.local()
        self._saved: list[tuple[Any, str, Any]] = []  # (owner, name, its own attribute or None)
        self._exempt = list(exempt)

    @property
    def total(self) -> int:
        return sum(self.syncs.values())

    def _quiet(self) -> bool:
        return bool(getattr(self._inside, "depth", 0))

    def _quietly(self, owner: Any, name: str, on_call: Callable[[], None] = lambda: None) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, vars(owner).get(name)))

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            on_call()
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.depth -= 1

        setattr(owner, name, wrapper)

    def _count_fetch(self) -> None:
        if not self._quiet():
            self.fetches += 1

    def _patch(self, owner: Any, name: str, counts: Callable[..., bool]) -> None:
        original = getattr(owner, name)
        self._saved.append((owner, name, vars(owner).get(name)))
        label = f"{getattr(owner, '__name__', owner)}.{name}"

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self._quiet() and counts(*args, **kwargs):
                self.syncs[label] += 1
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    def __enter__(self) -> HostSyncCounter:
        for name in TENSOR_METHODS:
            self._patch(torch.Tensor, name, lambda *a, **k: True)
        self._patch(torch, "nonzero", lambda *a, **k: True)
        self._patch(torch.Tensor, "repeat_interleave", lambda *a, **k: k.get("output_size") is None)
        self._patch(torch, "repeat_interleave", lambda *a, **k: len(a) > 1 and k.get("output_size") is None)
        self._patch(torch, "tensor", lambda *a, **k: k.get("device") is not None)
        self._patch(torch, "as_tensor", lambda *a, **k: k.get("device") is not None)
        self._patch(torch.Tensor, "to", _host_to_device)
        self._quietly(ReadyCopy, "wait", self._count_fetch)
        for owner, name in self._exempt:
            self._quietly(owner, name)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, own in reversed(self._saved):
            if own is None:
                delattr(owner, name)  # it was inherited
            else:
                setattr(owner, name, own)
        self._saved.clear()


def _host_to_device(t: torch.Tensor, *args: Any, **kwargs: Any) -> bool:
    """Tensor.to with a device target, from unpinned memory: a blocking copy on a GPU."""
    targets_device = kwargs.get("device") is not None or any(isinstance(a, (str, torch.device)) for a in args)
    return targets_device and t.device.type == "cpu" and not (torch.cuda.is_available() and t.is_pinned())
