"""KVSender / KVReceiver: the per-request objects a scheduler holds.

Every method returns at once: it validates its arguments (misuse raises
KVTransferError in the caller's thread) and queues a command for the manager's
background thread. poll() reads a state that thread advances.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kv_transfer.aux_buffer import AuxRow
from kv_transfer.base import FailureCause, KVPoll, KVTransferError, StateCell

if TYPE_CHECKING:
    from kv_transfer.aux_buffer import AuxBuffer


@dataclass(frozen=True)
class SendCmd:
    sender: KVSender
    pages: np.ndarray
    is_last: bool
    aux: AuxRow | None


@dataclass(frozen=True)
class AbortCmd:
    handle: _Handle
    reason: str


@dataclass(frozen=True)
class InitCmd:
    receiver: KVReceiver
    dst_pages: np.ndarray
    aux_slot: int
    skip_pages: int = 0


Command = SendCmd | AbortCmd | InitCmd | object
Submit = Callable[[Command], None]
FailHook = Callable[[StateCell, FailureCause, str], bool]


class _Handle:
    def __init__(self, rid: str, room: int, submit: Submit, fail: FailHook) -> None:
        if not 0 <= room < 2**63:
            raise KVTransferError(f"bootstrap room must be a 63-bit non-negative int, got {room}")
        self.rid = rid
        self.room = room
        self.cell = StateCell()
        self._submit = submit
        self._fail = fail

    def poll(self) -> KVPoll:
        return self.cell.state

    def wait(self, at_least: KVPoll, timeout_s: float) -> KVPoll:
        """Block until Failed or >= `at_least` (bounded); see StateCell.wait."""
        return self.cell.wait(at_least, timeout_s)

    @property
    def failure_reason(self) -> str | None:
        return self.cell.reason

    @property
    def failure_cause(self) -> FailureCause | None:
        return self.cell.cause

    def abort(self, reason: str = "aborted") -> None:
        """Fail the request now; the manager tells the peer. No-op once terminal."""
        if self._fail(self.cell, FailureCause.ABORTED, reason):
            self._submit(AbortCmd(self, reason))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rid={self.rid!r}, room={self.room}, state={self.poll().name})"


class KVSender(_Handle):
    """Prefill side, one per request. States: Bootstrapping (waiting for decode's page ids)
    -> WaitingForInput (num_dst_pages known) -> Transferring (first send) -> Success | Failed."""

    def __init__(self, rid: str, room: int, submit: Submit, fail: FailHook) -> None:
        super().__init__(rid, room, submit, fail)
        self.num_dst_pages: int | None = None  # set by the manager thread with WaitingForInput
        self.skip_pages = 0  # likewise: leading prompt pages decode holds already; never sent
        self._pages_sent = 0
        self._last_sent = False
        self.watched_at = time.monotonic()  # the engine's last poll(): it still looks after the request

    def poll(self) -> KVPoll:
        """The state; also the engine's sign of life for this request (see PrefillSide.live_rooms)."""
        self.watched_at = time.monotonic()
        return self.cell.state

    def send(self, src_page_ids: Sequence[int], is_last: bool, aux: AuxRow | None = None) -> None:
        """Queue WRITEs of `src_page_ids` into the next decode pages, in request order.

        A non-last send carries whole pages only; the last one may end with a partial page
        (it is written whole) and must carry the aux row. No-op when already Failed."""
        state = self.poll()
        if state == KVPoll.Failed:
            return
        if state < KVPoll.WaitingForInput or self.num_dst_pages is None:
            raise KVTransferError(f"send() before WaitingForInput ({self!r})")
        if self._last_sent:
            raise KVTransferError(f"send() after the last send ({self!r})")
        pages = np.asarray(src_page_ids, dtype=np.int64)
        total = self._pages_sent + pages.size
        if total > self.num_dst_pages:
            raise KVTransferError(f"{total} pages sent but decode allocated {self.num_dst_pages} ({self!r})")
        if is_last and total != self.num_dst_pages:
            raise KVTransferError(f"last send ends at page {total}, decode allocated {self.num_dst_pages}")
        if is_last and aux is None:
            raise KVTransferError("the last send must carry the aux row")
        self._pages_sent = total
        self._last_sent = is_last
        self.cell.advance(KVPoll.Transferring)
        self._submit(SendCmd(self, pages, is_last, aux))


class KVReceiver(_Handle):
    """Decode side, one per request. States: Bootstrapping (handshake with the prefill)
    -> WaitingForInput (peer registered) -> Transferring (init() called) -> Success | Failed.

    After Failed (abort, timeout, peer loss) the scheduler frees the request's pages only
    once pages_releasable() is True: prefill confirmed its writes drained, or
    drain_timeout_s passed."""

    def __init__(
        self, rid: str, room: int, host: str, port: int, aux: AuxBuffer, num_pages: int, submit: Submit, fail: FailHook
    ) -> None:
        super().__init__(rid, room, submit, fail)
        self.host = host
        self.port = port
        self._aux = aux
        self._num_pages = num_pages
        self.aux_slot: int | None = None
        self.drained = False  # set by the manager thread
        self.drain_deadline: float | None = None  # set by the manager thread when it fails a sent request
        self.request_sent = False  # set by the manager thread

    def init(self, dst_page_ids: Sequence[int], aux_slot: int, skip_pages: int = 0) -> None:
        """Hand over the pages (the prompt's from page `skip_pages` on, request order: decode
        holds the first `skip_pages` already) and the aux slot; may be called while still
        Bootstrapping (the request goes out once the peer is registered)."""
        if self.aux_slot is not None:
            raise KVTransferError(f"init() called twice ({self!r})")
        pages = np.asarray(dst_page_ids, dtype=np.int64)
        if pages.ndim != 1 or pages.size == 0:
            raise KVTransferError("init() needs a non-empty flat list of page ids")
        if pages.min() < 0 or pages.max() >= self._num_pages:
            raise KVTransferError(f"page id out of range [0, {self._num_pages})")
        if np.unique(pages).size != pages.size:
            raise KVTransferError("init() got duplicate page ids")
        if not 0 <= aux_slot < self._aux.num_slots:
            raise KVTransferError(f"aux slot {aux_slot} out of range")
        if skip_pages < 0:
            raise KVTransferError(f"skip_pages must be >= 0, got {skip_pages}")
        self.aux_slot = aux_slot
        if self.poll() == KVPoll.Failed:
            self.drained = True
            return
        self._aux.clear_row(aux_slot)
        self.cell.advance(KVPoll.Transferring)
        self._submit(InitCmd(self, pages, aux_slot, skip_pages))

    def aux_row(self) -> AuxRow | None:
        """The aux row prefill wrote (valid after Success)."""
        return None if self.aux_slot is None else self._aux.read_row(self.aux_slot)

    def pages_releasable(self) -> bool:
        if self.aux_slot is None:
            return True
        state = self.poll()
        if state == KVPoll.Success:
            return True
        if state != KVPoll.Failed:
            return False
        # The deadline is checked here too, so the pages come back even if the manager
        # thread that would mark them drained is gone.
        return self.drained or (self.drain_deadline is not None and time.monotonic() >= self.drain_deadline)
