"""Aux rows: the small per-request record that travels with the last KV send.

    aux tensor: uint8 [num_slots, ROW_BYTES]   (row format: kv_transfer/aux_format.py)

Decode clears its row at receiver.init() and accepts the transfer only when the row
carries the magic and the expected room. Decode's scheduler allocates aux slots with an
AuxSlotAllocator; prefill's KVManager allocates its own source rows internally.
Both sides check each other's ROW_BYTES at registration (a v1 peer is refused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.aux_format import MAX_TOP_LOGPROBS, ROW_BYTES
from kv_transfer.aux_format import ROW_HEAD as _HEAD
from kv_transfer.aux_format import ROW_MAGIC as _MAGIC
from kv_transfer.aux_format import ROW_TOP_ENTRY as _TOP


@dataclass(frozen=True)
class AuxRow:
    first_token: int
    cached_tokens: int = 0
    logprob: float | None = None
    room: int = 0  # set by the sender; callers need not fill it
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob) of the first token's top k


class AuxBuffer:
    """`num_slots` fixed-size rows over one contiguous uint8 CPU tensor (registered with NIXL)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("AuxBuffer needs at least one slot")
        self.num_slots = num_slots
        self.row_bytes = ROW_BYTES
        self.tensor = torch.zeros((num_slots, ROW_BYTES), dtype=torch.uint8)

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"aux slot {slot} out of range [0, {self.num_slots})")

    def write_row(self, slot: int, row: AuxRow) -> None:
        self._check(slot)
        if len(row.top_logprobs) > MAX_TOP_LOGPROBS:
            raise ValueError(f"{len(row.top_logprobs)} top logprobs do not fit an aux row (max {MAX_TOP_LOGPROBS})")
        packed = _HEAD.pack(
            _MAGIC,
            row.room,
            row.first_token,
            row.cached_tokens,
            0.0 if row.logprob is None else row.logprob,
            row.logprob is not None,
            len(row.top_logprobs),
        ) + b"".join(_TOP.pack(token, lp) for token, lp in row.top_logprobs)
        data = torch.frombuffer(bytearray(packed.ljust(ROW_BYTES, b"\0")), dtype=torch.uint8)
        self.tensor[slot].copy_(data)

    def read_row(self, slot: int) -> AuxRow | None:
        """The row at `slot`, or None when it was cleared / never written."""
        self._check(slot)
        raw = self.tensor[slot].numpy().tobytes()
        magic, room, first, cached, logprob, has_lp, num_top = _HEAD.unpack_from(raw)
        if magic != _MAGIC or num_top > MAX_TOP_LOGPROBS:
            return None
        top = tuple(_TOP.unpack_from(raw, _HEAD.size + i * _TOP.size) for i in range(num_top))
        return AuxRow(first_token=first, cached_tokens=cached, logprob=logprob if has_lp else None, room=room,
                      top_logprobs=top)

    def clear_row(self, slot: int) -> None:
        self._check(slot)
        self.tensor[slot].zero_()

    def row_offset(self, slot: int) -> int:
        return slot * ROW_BYTES


class AuxSlotAllocator:
    """Free list of aux slots. Owned by one thread (decode: the scheduler)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"aux slot {slot} freed twice or never allocated")
        self._used.remove(slot)
        self._free.append(slot)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate slot in the aux free list (bug)"
        assert not (free & self._used), "aux slot both free and used (bug)"
        assert len(free) + len(self._used) == self.num_slots, (
            f"aux slots leaked: free {len(free)} + used {len(self._used)} != {self.num_slots}"
        )
