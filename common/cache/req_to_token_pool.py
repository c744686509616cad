"""Request rows -> token slots: the table the attention backends index.

    table[row, i] = token slot of token i of the request in `row`
                    (slot = page * page_size + offset, see kv_pool.py)

Who owns what: the scheduler allocates a row when a request is admitted and
frees it when the request finishes, aborts or is retracted; the pages behind the
slots are owned by the PageAllocator / RadixCache, never by this table. Entries
of free rows and entries past a request's length are 0 (page 0 is the reserved
scratch page), so a stray read or padded write never touches a live page.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.cache.errors import PoolInvariantError
from common.model.device_streams import DeviceStreams, HostStreams


class ReqToTokenPool:
    def __init__(
        self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu", streams: DeviceStreams | None = None
    ) -> None:
        """streams: orders the scheduler's writes (row zeroing) after the worker's queued steps."""
        if max_reqs < 1 or max_context_len < 1:
            raise ValueError(f"max_reqs={max_reqs}, max_context_len={max_context_len} must be >= 1")
        self.max_reqs = max_reqs
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.streams = streams or HostStreams(self.device)
        self.table = torch.zeros((max_reqs, max_context_len), dtype=torch.int64, device=self.device)
        self._free: list[int] = list(range(max_reqs - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * max_reqs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.max_reqs - len(self._free)

    def alloc(self) -> int | None:
        """A free row (its entries are all 0), or None when every row is taken."""
        if not self._free:
            return None
        row = self._free.pop()
        self._is_free[row] = 0
        return row

    def free(self, row: int) -> None:
        """Release a row and zero it. Raises on a double free or a row out of range."""
        if not 0 <= row < self.max_reqs or self._is_free[row]:
            what = "out of range" if not 0 <= row < self.max_reqs else "already free (double free)"
            raise PoolInvariantError(f"ReqToTokenPool.free(): row {row} is {what}")
        self.streams.scheduler_waits_for_worker()  # a step in flight may still read the row
        self.table[row].zero_()
        self._is_free[row] = 1
        self._free.append(row)

    def write(self, row: int, start: int, slots: Sequence[int] | torch.Tensor) -> None:
        """table[row, start : start + len(slots)] = slots."""
        if self._is_free[row]:
            raise PoolInvariantError(f"ReqToTokenPool.write(): row {row} is not allocated")
        end = start + len(slots)
        if start < 0 or end > self.max_context_len:
            raise ValueError(
                f"write [{start}, {end}) outside the row (max_context_len={self.max_context_len})"
            )
        if isinstance(slots, torch.Tensor):
            self.table[row, start:end] = slots.to(device=self.device, dtype=torch.int64)
        else:
            self.table[row, start:end] = torch.tensor(slots, dtype=torch.int64, device=self.device)

    def read(self, row: int, start: int, end: int) -> list[int]:
        """table[row, start:end] as Python ints (synchronises when the table lives on a GPU)."""
        out: list[int] = self.table[row, start:end].tolist()
        return out

    def check_integrity(self) -> None:
        """Free stack and flags agree, no duplicates; free rows are all zeros."""
        free = self._free
        if len(set(free)) != len(free) or any(not 0 <= r < self.max_reqs for r in free):
            raise PoolInvariantError("ReqToTokenPool free stack holds a duplicate or out-of-range row")
        if sum(self._is_free) != len(free) or not all(self._is_free[r] for r in free):
            raise PoolInvariantError("ReqToTokenPool free flags disagree with the free stack")
        if free and bool(self.table[free].any()):
            raise PoolInvariantError("ReqToTokenPool: a free row holds non-zero slots")

    def __repr__(self) -> str:
        return f"ReqToTokenPool(free={self.num_free}/{self.max_reqs}, max_context_len={self.max_context_len})"
