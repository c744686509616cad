"""Prefill's bootstrap bookkeeping in isolation (in-process, a fake NIXL endpoint): which
Register replaces which, who may abort, and the caps on peers, early requests and tombstones."""

from __future__ import annotations

import dataclasses

import msgspec

from kv_transfer import TransferConfig
from kv_transfer.messages import Abort, RegisterAck, RegisterRefused, Status, TransferRequest
from kv_transfer.prefill_side import PrefillSide
from tests.kv_transfer.test_register_memory_type import FakeEndpoint, prefill_side, register


class Endpoint(FakeEndpoint):
    def __init__(self) -> None:
        super().__init__("DRAM")
        self.removed: list[str] = []

    def remove_peer(self, name: str) -> None:
        self.removed.append(name)


def side(**cfg: object) -> tuple[PrefillSide, list[object]]:
    replies: list[object] = []
    s = prefill_side(Endpoint(), replies)  # type: ignore[arg-type]
    s.cfg = dataclasses.replace(TransferConfig(), **cfg)  # type: ignore[arg-type]
    return s, replies


def reg(s: PrefillSide, token: bytes, name: str = "decode-fake"):  # type: ignore[no-untyped-def]
    return msgspec.structs.replace(register("DRAM", s.aux.row_bytes), agent_name=name, instance_token=token)


def test_a_register_replaces_a_peer_only_with_its_instance_token() -> None:
    s, replies = side()
    s.on_message(b"real", reg(s, b"token-1"))
    s.on_message(b"spoof", reg(s, b"guessed"))
    assert isinstance(replies[-1], RegisterRefused) and "already registered" in replies[-1].reason
    assert set(s.peers) == {b"real"}
    s.on_message(b"real-reconnected", reg(s, b"token-1"))  # the same decode on a new connection
    assert isinstance(replies[-1], RegisterAck) and set(s.peers) == {b"real-reconnected"}


def test_aborts_and_requests_need_a_registration_and_stay_bounded() -> None:
    s, replies = side(max_tombstones=3, max_early_requests=2, max_reason_chars=10)
    s.on_message(b"stranger", Abort(1, "x" * 1000))
    assert s.tombstones == {} and isinstance(replies[-1], Status) and replies[-1].reregister
    s.on_message(b"d", reg(s, b"t"))
    for room in range(10):
        s.on_message(b"d", Abort(room, "y" * 1000))
    assert list(s.tombstones) == [7, 8, 9]  # the oldest forgotten first
    assert all(len(t.reason) <= len("aborted by decode: ") + 10 for t in s.tombstones.values())
    for room in range(100, 104):
        s.on_message(b"d", TransferRequest(room, [1, 2], 0))
    assert list(s.early) == [100, 101] and "transfer requests" in replies[-1].reason
    num_pages = s.peers[b"d"].reg.layout.num_pages
    s.on_message(b"d", TransferRequest(200, list(range(num_pages + 1)), 0))
    assert 200 not in s.early and not replies[-1].ok


def test_peers_are_capped() -> None:
    s, replies = side(max_peers=2)
    for i in range(3):
        s.on_message(f"d{i}".encode(), reg(s, b"t", name=f"decode-{i}"))
    assert len(s.peers) == 2 and isinstance(replies[-1], RegisterRefused) and "too many" in replies[-1].reason
