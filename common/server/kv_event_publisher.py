"""Publishes an instance's radix cache contents (KV events) on a ZMQ PUB socket.

Owned by the engine (EngineCore): the RadixCache calls stored/removed/cleared as it
changes, the engine loop calls flush() once per iteration, which sends the net change
as one KVEventBatch, and a KVSnapshot of everything held every `snapshot_interval_s`
(common/cache/kv_events.py has the wire). Sending never blocks: a subscriber that is
slow or gone loses messages (ZMQ's high-water mark), sees the seq gap, and resyncs from
the next snapshot. Binds the instance's --host only; with a cluster secret the socket is a
CURVE server that only the cluster's clients (the router) can subscribe to, encrypted.
"""

from __future__ import annotations

import logging
import secrets
import time

import msgspec
import zmq

from common.cache.kv_events import KVEventBatch, KVSnapshot
from common.cluster_secret import ClusterSecret
from common.zmq_curve import CurveSecurity

logger = logging.getLogger(__name__)

SEND_HWM = 1000
MAX_INBOUND_BYTES = 4096  # a subscriber sends only its subscriptions


class KVEventPublisher:
    def __init__(self, host: str, port: int, page_size: int, *, secret: ClusterSecret | None = None,
                 snapshot_interval_s: float = 1.0) -> None:
        self.page_size = page_size
        self.snapshot_interval_s = snapshot_interval_s
        self.epoch = secrets.randbits(63)
        self.seq = 0
        self.held: set[int] = set()
        self._added: set[int] = set()
        self._dropped: set[int] = set()
        self._cleared = False
        self._last_snapshot = 0.0
        self._encoder = msgspec.msgpack.Encoder()
        ctx: zmq.Context = zmq.Context.instance()
        self._sock: zmq.Socket = ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._security = CurveSecurity(ctx, secret.events_curve() if secret else None, MAX_INBOUND_BYTES)
        self._security.serve(self._sock)
        addr = f"tcp://{host}"
        self.port = self._sock.bind_to_random_port(addr) if port == 0 else port
        if port != 0:
            self._sock.bind(f"{addr}:{port}")
        logger.info("KV events published on %s:%d", addr, self.port)

    # ---- KVEventSink (called by the RadixCache) ---------------------------------------------
    def stored(self, hashes: list[int]) -> None:
        for h in hashes:
            self.held.add(h)
            if h in self._dropped:
                self._dropped.discard(h)
            else:
                self._added.add(h)

    def removed(self, hashes: list[int]) -> None:
        for h in hashes:
            self.held.discard(h)
            if h in self._added:
                self._added.discard(h)
            else:
                self._dropped.add(h)

    def cleared(self) -> None:
        self.held.clear()
        self._added.clear()
        self._dropped.clear()
        self._cleared = True

    # ---- engine loop ------------------------------------------------------------------------
    def flush(self, now: float | None = None) -> None:
        if self._added or self._dropped or self._cleared:
            self.seq += 1
            self._send(KVEventBatch(self.epoch, self.seq, sorted(self._added), sorted(self._dropped), self._cleared))
            self._added.clear()
            self._dropped.clear()
            self._cleared = False
        now = time.monotonic() if now is None else now
        if now - self._last_snapshot >= self.snapshot_interval_s:
            self._last_snapshot = now
            self._send(KVSnapshot(self.epoch, self.seq, self.page_size, sorted(self.held)))

    def _send(self, msg: KVEventBatch | KVSnapshot) -> None:
        try:
            self._sock.send(self._encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            pass  # no room for a slow subscriber: it resyncs from a later snapshot

    def close(self) -> None:
        self._sock.close(0)
        self._security.close()
