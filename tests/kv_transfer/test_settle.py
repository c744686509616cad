"""A failed room tells decode only once its WRITEs can no longer land (fake endpoint).

A poll that raises without NIXL reporting ERR (an injected fault, or an exception from
the poll itself) says nothing about the transfer: its writes may still be executing,
and decode frees the room's pages as soon as prefill's failure Status arrives. Prefill
must keep polling the real state, bounded by settle_timeout_s, before it reports."""

from __future__ import annotations

import time

import zmq

from common.cache.kv_pool import KVLayout
from kv_transfer.aux_buffer import AuxBuffer
from kv_transfer.base import FailureCause, KVPoll, TransferConfig
from kv_transfer.faults import FaultInjector, FaultSpec
from kv_transfer.handles import KVSender
from kv_transfer.head_slices import HeadSlice
from kv_transfer.messages import ControlMsg, PrefillInfo, Status
from kv_transfer.metrics import TransferMetrics
from kv_transfer.nixl_endpoint import NixlError, PostedXfer
from kv_transfer.prefill_side import PrefillSide, _DecodePeer, _Room
from kv_transfer.side import layout_to_wire

LAYOUT = KVLayout(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=4, dtype="float32")


class FakeEndpoint:
    """One outstanding transfer: the first poll fails as `first_error` says, the real state
    is DONE from poll number `done_at` on (or ERR when `err`)."""

    def __init__(self, first_error: NixlError, done_at: int, err: bool = False, keeps_raising: bool = False) -> None:
        self.first_error, self.done_at, self.err, self.keeps_raising = first_error, done_at, err, keeps_raising
        self.polls = 0
        self.released: list[PostedXfer] = []
        self.removed_peers: list[str] = []

    def is_done(self, xfer: PostedXfer, *, inject: bool = True) -> bool:
        self.polls += 1
        if self.polls == 1 or self.keeps_raising:
            raise self.first_error
        if self.err:
            raise NixlError("transfer failed: state ERR", terminal=True)
        return self.polls >= self.done_at

    def release(self, xfer: PostedXfer) -> None:
        self.released.append(xfer)

    def remove_peer(self, name: str) -> None:
        self.removed_peers.append(name)


class RecordingSide(PrefillSide):
    def __init__(self, endpoint: FakeEndpoint, cfg: TransferConfig) -> None:
        info = PrefillInfo(1, "prefill-test", "127.0.0.1", 1, layout_to_wire(LAYOUT), 384)
        super().__init__(cfg=cfg, layout=LAYOUT, endpoint=endpoint, slices=[HeadSlice(0, LAYOUT.num_kv_heads, [0] * 2 * LAYOUT.num_layers)], aux=AuxBuffer(2), info=info,
                         faults=FaultInjector(FaultSpec()), metrics=TransferMetrics("prefill"),
                         fail=lambda cell, cause, reason: cell.fail(cause, reason), poller=zmq.Poller(), ctx=None)
        self.replies: list[tuple[float, ControlMsg]] = []
        self.t0 = time.monotonic()

    def reply(self, identity: bytes, msg: ControlMsg) -> None:
        self.replies.append((self.now, msg))

    def start_room(self) -> KVSender:
        sender = KVSender("rid", 7, submit=lambda cmd: None, fail=lambda cell, cause, reason: cell.fail(cause, reason))
        peer = _DecodePeer(b"decode", None, "decode-agent", 0.0, [])  # type: ignore[arg-type]
        self.peers[peer.identity] = peer
        room = _Room(sender, 0.0, peer=peer)
        room.outstanding.append(PostedXfer(object(), 4096, 1))
        self.rooms[7] = room
        return sender

    def run(self, ticks: list[float]) -> None:
        """One _progress per tick; ticks are seconds after the side was made (failures are
        stamped with the real monotonic clock)."""
        for offset in ticks:
            self.now = offset
            for room in list(self.rooms.values()):
                self._progress(room, self.t0 + offset)


def test_a_poll_fault_waits_for_the_transfer_before_reporting() -> None:
    endpoint = FakeEndpoint(NixlError("injected fail_poll", injected=True), done_at=4)
    side = RecordingSide(endpoint, TransferConfig(settle_timeout_s=5.0))
    sender = side.start_room()
    side.run([0.1, 0.2])
    assert sender.poll() == KVPoll.Failed and not side.replies  # failed, but decode not told yet
    assert not endpoint.released
    side.run([0.3, 0.4])
    (at, status), = side.replies
    assert isinstance(status, Status) and not status.ok and status.cause == FailureCause.TRANSFER_ERROR.value
    assert at == 0.4 and endpoint.polls == 4 and len(endpoint.released) == 1  # after the real DONE
    side.check_integrity()


def test_a_transfer_that_never_settles_is_reported_at_the_settle_timeout() -> None:
    endpoint = FakeEndpoint(NixlError("poll raised", injected=False), done_at=10**9, keeps_raising=True)
    side = RecordingSide(endpoint, TransferConfig(settle_timeout_s=2.0))
    side.start_room()
    side.run([0.0, 1.0, 1.9])
    assert not side.replies
    side.run([2.1])
    assert [m.ok for _, m in side.replies] == [False] and len(endpoint.released) == 1
    assert endpoint.removed_peers == ["decode-agent"] and not side.peers  # dropped once, not per poll


def test_nixl_err_is_terminal_and_reported_at_once() -> None:
    endpoint = FakeEndpoint(NixlError("transfer failed: state ERR", terminal=True), done_at=10**9)
    side = RecordingSide(endpoint, TransferConfig(settle_timeout_s=5.0))
    side.start_room()
    side.run([0.5])
    assert [(at, m.ok) for at, m in side.replies] == [(0.5, False)] and len(endpoint.released) == 1


