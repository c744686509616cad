"""Prefill refuses, at registration, a decode whose KV pool is on another kind of memory.

A NIXL WRITE names one memory type for both ends (prefill_side posts every KV descriptor
list with its own pool's type), so a GPU prefill with a CPU decode, or the reverse, used to
pass the handshake and then fail every transfer. The prefill side runs here against a fake
endpoint: no NIXL agent, no sockets.
"""

from __future__ import annotations

import pytest
import zmq

from common.cache.kv_pool import KVLayout
from kv_transfer.aux_buffer import AuxBuffer
from kv_transfer.base import TransferConfig
from kv_transfer.faults import FaultInjector, FaultSpec
from kv_transfer.head_slices import HeadSlice
from kv_transfer.messages import PROTOCOL_VERSION, PrefillInfo, Register, RegisterAck, RegisterRefused
from kv_transfer.metrics import TransferMetrics
from kv_transfer.prefill_side import PrefillSide
from kv_transfer.side import layout_to_wire

LAYOUT = KVLayout(num_layers=2, num_pages=64, page_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")


class FakeEndpoint:
    """The part of NixlEndpoint that a registration touches."""

    name = "prefill-fake"

    def __init__(self, kv_mem_type: str) -> None:
        self.kv_mem_type = kv_mem_type
        self.kv_device = 0
        self.peers_added: list[bytes] = []

    def add_peer(self, metadata: bytes) -> str:
        self.peers_added.append(metadata)
        return "decode-fake"


def prefill_side(endpoint: FakeEndpoint, replies: list[object]) -> PrefillSide:
    aux = AuxBuffer(4)
    info = PrefillInfo(PROTOCOL_VERSION, endpoint.name, "127.0.0.1", 1, layout_to_wire(LAYOUT), aux.row_bytes)
    side = PrefillSide(
        cfg=TransferConfig(), layout=LAYOUT, endpoint=endpoint, slices=[HeadSlice(0, LAYOUT.num_kv_heads, [0] * 2 * LAYOUT.num_layers)],  # type: ignore[arg-type]
        aux=aux, info=info, faults=FaultInjector(FaultSpec()), metrics=TransferMetrics("prefill"),
        fail=lambda *_: True, poller=zmq.Poller(), ctx=zmq.Context.instance(),
    )
    side.reply = lambda identity, msg: replies.append(msg)  # type: ignore[method-assign]
    return side


def register(kv_mem_type: str, aux_row_bytes: int) -> Register:
    return Register(
        PROTOCOL_VERSION, "decode-fake", b"decode agent metadata", layout_to_wire(LAYOUT), [4096],
        kv_mem_type, 0, 1 << 20, aux_row_bytes, 4, b"token",
    )


@pytest.mark.parametrize(("prefill_mem", "decode_mem"), [("VRAM", "DRAM"), ("DRAM", "VRAM")])
def test_registration_needs_the_same_kv_memory_type(prefill_mem: str, decode_mem: str) -> None:
    replies: list[object] = []
    endpoint = FakeEndpoint(prefill_mem)
    side = prefill_side(endpoint, replies)
    side.on_message(b"decode-0", register(decode_mem, side.aux.row_bytes))
    assert len(replies) == 1 and isinstance(replies[0], RegisterRefused), replies
    assert "KV memory type mismatch" in replies[0].reason and replies[0].cause == "layout_mismatch"
    assert "GPU memory (VRAM)" in replies[0].reason and "host memory (DRAM)" in replies[0].reason
    assert endpoint.peers_added == [] and side.peers == {}  # never handed to NIXL
    side.on_message(b"decode-0", register(prefill_mem, side.aux.row_bytes))  # the same decode, fixed
    assert isinstance(replies[1], RegisterAck), replies
    assert endpoint.peers_added == [b"decode agent metadata"] and list(side.peers) == [b"decode-0"]

