"""What the prefill and decode halves of a KVManager's background thread share."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq

from common.cache.kv_pool import KVLayout
from common.zmq_curve import CurveSecurity
from kv_transfer.base import FailureCause, StateCell, TransferConfig
from kv_transfer.endpoint import TransferEndpoint
from kv_transfer.messages import ControlMsg, WireLayout, decode, encode
from kv_transfer.metrics import TransferMetrics

log = logging.getLogger("kv_transfer")
RECV_BATCH = 1000  # messages per readable socket per loop iteration: timers and other peers get a turn


def layout_to_wire(layout: KVLayout) -> WireLayout:
    return WireLayout(
        layout.num_layers, layout.num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim, layout.dtype,
        layout.order,
    )


def layout_from_wire(w: WireLayout) -> KVLayout:
    return KVLayout(
        num_layers=w.num_layers,
        num_pages=w.num_pages,
        page_size=w.page_size,
        num_kv_heads=w.num_kv_heads,
        head_dim=w.head_dim,
        dtype=w.dtype,
        order=w.order or "per-layer buffers (protocol < 6)",
    )


def send_nowait(sock: zmq.Socket, frames: list[bytes]) -> bool:
    """Never blocks: a full queue or an unroutable peer drops the message (heartbeats and
    timeouts notice a dead peer)."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
        return True
    except zmq.ZMQError as e:
        log.debug("control send dropped: %s", e)
        return False


def recv_all(sock: zmq.Socket, limit: int = RECV_BATCH) -> Iterator[tuple[bytes, ControlMsg]]:
    """The messages waiting on `sock` (at most `limit`), one at a time as (routing id or b"",
    message): each is handled before the next is decoded, so a flood never sits decoded in
    memory at once. Malformed ones are logged and skipped."""
    for _ in range(limit):
        try:
            frames = sock.recv_multipart(flags=zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            msg = decode(frames[-1])
        except msgspec.DecodeError as e:
            log.warning("dropped a malformed control message: %s", e)
            continue
        yield frames[0] if len(frames) > 1 else b"", msg


class Side:
    def __init__(
        self,
        *,
        cfg: TransferConfig,
        endpoint: TransferEndpoint,
        metrics: TransferMetrics,
        fail: Callable[[StateCell, FailureCause, str], bool],
        poller: zmq.Poller,
        ctx: zmq.Context,
        security: CurveSecurity | None = None,
        sock: zmq.Socket | None = None,
    ) -> None:
        self.security = security
        self.cfg = cfg
        self.endpoint = endpoint
        self.metrics = metrics
        self.fail = fail
        self.poller = poller
        self.ctx = ctx
        self.sock = sock  # prefill: the ROUTER on the bootstrap port
        self.log = log

    def reply(self, identity: bytes, msg: ControlMsg) -> None:
        assert self.sock is not None, "reply() needs the ROUTER socket (bug)"
        send_nowait(self.sock, [identity, encode(msg)])

    def on_readable(self, sock: zmq.Socket) -> None:
        for identity, msg in recv_all(sock):
            self.on_message(identity, msg)

    def on_message(self, identity: bytes, msg: ControlMsg) -> None:
        raise NotImplementedError

    def create(self, handle: Any) -> None:
        raise NotImplementedError

    def command(self, cmd: object) -> None:
        raise NotImplementedError

    def check_peers(self, now: float) -> None:
        """Liveness checks that must run before queued messages are read (see PrefillSide)."""

    def tick(self, now: float) -> bool:
        """Periodic work; True while something is in flight (the loop then polls fast)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def check_integrity(self) -> None:
        raise NotImplementedError
