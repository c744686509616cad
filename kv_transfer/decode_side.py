"""Decode half of the manager thread: one DEALER per prefill peer, handshakes, heartbeats,
per-room requests, status handling, timeouts and page-release (drain) bookkeeping.

Runs only in the KVManager's background thread.

    create_receiver ─> peer handshaking ─(RegisterAck)─> registered: receivers WaitingForInput
    init ─> TransferRequest sent ─(Status ok + aux row room matches)─> Success
    transfer deadline: transfer_timeout_s after the request went out or prefill's last
        mention of the room in a Pong (queued, computing, writing with progress), whichever is later
    Status failed / abort / timeout / peer lost ─> Failed; pages releasable once prefill's
        Status for the room arrived (its writes drained) or drain_timeout_s passed

A prefill restarted at the same address (a crash, a reschedule) is a new process with a new
NIXL agent; the DEALER reconnects to it by itself. It answers our requests with
Status(reregister) and our pings with its new name: the peer registers anew, a request it never
saw is sent again (once), and every request sent to the old agent fails at once (PEER_LOST;
its pages drain as usual). A peer is thus keyed by address plus the agent that acked it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import zmq

from common.cache.kv_pool import KVLayout
from kv_transfer.aux_buffer import AuxBuffer
from kv_transfer.base import FailureCause, KVPoll
from kv_transfer.handles import AbortCmd, InitCmd, KVReceiver
from kv_transfer.head_slices import split_compatible
from kv_transfer.messages import (
    Abort,
    ControlMsg,
    Ping,
    Pong,
    Register,
    RegisterAck,
    RegisterRefused,
    Status,
    TransferRequest,
    encode,
)
from kv_transfer.side import Side, layout_from_wire, recv_all, send_nowait

PeerKey = tuple[str, int]


@dataclass
class _PrefillPeer:
    key: PeerKey
    sock: zmq.Socket
    started: float
    last_seen: float
    registered: bool = False
    prefill_agent: str = ""
    last_ping: float = 0.0
    recvs: dict[int, _Recv] = field(default_factory=dict)


@dataclass
class _Recv:
    receiver: KVReceiver
    init: InitCmd | None = None
    sent_at: float | None = None
    alive_at: float = 0.0  # prefill's last mention of the room in a Pong (its sign of life)
    sent_to: str = ""  # the prefill agent that was registered when the request went out
    resent: bool = False  # re-sent once after a restarted prefill asked us to register again


class DecodeSide(Side):
    def __init__(self, *, layout: KVLayout, aux: AuxBuffer, register: Register, total_heads: int, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.layout = layout
        self.total_heads = total_heads  # KV heads over all TP ranks
        self.aux = aux
        self.register_msg = register
        self.peers: dict[PeerKey, _PrefillPeer] = {}
        self.draining: list[tuple[PeerKey, _Recv]] = []
        self._ids = itertools.count()
        self._ping_seq = itertools.count()

    # ---- peers --------------------------------------------------------------------------
    def _peer(self, key: PeerKey, now: float) -> _PrefillPeer:
        peer = self.peers.get(key)
        if peer is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.cfg.send_hwm)
            sock.setsockopt(zmq.ROUTING_ID, f"{self.endpoint.name}#{next(self._ids)}".encode())
            if self.security is not None:
                self.security.connect(sock)
            sock.connect(f"tcp://{key[0]}:{key[1]}")
            self.poller.register(sock, zmq.POLLIN)
            peer = _PrefillPeer(key, sock, now, now)
            self.peers[key] = peer
            self._send(peer, self.register_msg)
        return peer

    def _send(self, peer: _PrefillPeer, msg: ControlMsg) -> None:
        send_nowait(peer.sock, [encode(msg)])

    def _drop_peer(self, peer: _PrefillPeer, cause: FailureCause, reason: str, now: float) -> None:
        self.log.warning("dropping prefill %s:%d: %s", *peer.key, reason)
        self.peers.pop(peer.key, None)
        self.poller.unregister(peer.sock)
        peer.sock.close(linger=0)
        for rec in list(peer.recvs.values()):
            self._fail(peer, rec, cause, reason, now, notify=False)
        peer.recvs.clear()

    def _fail(self, peer: _PrefillPeer, rec: _Recv, cause: FailureCause, reason: str, now: float, *, notify: bool) -> None:
        """Fail `rec` (if not yet terminal) and move it to draining while prefill may still write."""
        self.fail(rec.receiver.cell, cause, reason)
        peer.recvs.pop(rec.receiver.room, None)
        if rec.sent_at is None or rec.receiver.poll() == KVPoll.Success:
            rec.receiver.drained = True
            if notify:  # also while handshaking: prefill may hold the room, waiting for page ids
                self._send(peer, Abort(rec.receiver.room, reason))
            return
        if notify:
            self._send(peer, Abort(rec.receiver.room, reason))
        rec.receiver.drain_deadline = now + self.cfg.drain_timeout_s
        self.draining.append((peer.key, rec))

    # ---- scheduler commands -------------------------------------------------------------
    def create(self, receiver: KVReceiver) -> None:
        now = time.monotonic()
        peer = self._peer((receiver.host, receiver.port), now)
        if receiver.room in peer.recvs:
            why = f"room {receiver.room} already has a live receiver for this prefill"
            self.fail(receiver.cell, FailureCause.DUPLICATE_ROOM, why)
            return
        peer.recvs[receiver.room] = _Recv(receiver)
        if peer.registered:
            receiver.cell.advance(KVPoll.WaitingForInput)

    def command(self, cmd: object) -> None:
        now = time.monotonic()
        handle = cmd.receiver if isinstance(cmd, InitCmd) else cmd.handle if isinstance(cmd, AbortCmd) else None
        if not isinstance(handle, KVReceiver):
            return
        peer = self.peers.get((handle.host, handle.port))
        rec = peer.recvs.get(handle.room) if peer is not None else None
        if peer is None or rec is None or rec.receiver is not handle:
            handle.drained = handle.drained or not handle.request_sent
            return
        if isinstance(cmd, InitCmd):
            rec.init = cmd
            if handle.poll() == KVPoll.Failed:
                self._fail(peer, rec, FailureCause.ABORTED, handle.failure_reason or "aborted", now, notify=True)
            elif peer.registered:
                self._send_request(peer, rec, now)
        elif isinstance(cmd, AbortCmd):
            self._fail(peer, rec, FailureCause.ABORTED, cmd.reason, now, notify=True)

    def _send_request(self, peer: _PrefillPeer, rec: _Recv, now: float) -> None:
        assert rec.init is not None
        init = rec.init
        self._send(peer, TransferRequest(rec.receiver.room, init.dst_pages.tolist(), init.aux_slot, init.skip_pages))
        rec.sent_at = now
        rec.sent_to = peer.prefill_agent
        rec.receiver.request_sent = True

    def _register_again(self, peer: _PrefillPeer, now: float) -> None:
        if peer.registered:
            peer.registered = False
            peer.started = now
            self._send(peer, self.register_msg)

    # ---- control messages ---------------------------------------------------------------
    def on_readable(self, sock: zmq.Socket) -> None:
        peer = next((p for p in self.peers.values() if p.sock is sock), None)
        if peer is None:
            return
        now = time.monotonic()
        for _, msg in recv_all(sock):
            if peer.key not in self.peers:
                return
            peer.last_seen = now
            self._on_message(peer, msg, now)

    def _on_message(self, peer: _PrefillPeer, msg: ControlMsg, now: float) -> None:
        if isinstance(msg, RegisterAck):
            remote = layout_from_wire(msg.info.layout)
            spans = msg.info.head_slices or [[0, remote.num_kv_heads]]
            reason = split_compatible(self.layout, self.total_heads, remote, max(a + n for a, n in spans))
            if reason is not None:
                self._drop_peer(peer, FailureCause.LAYOUT_MISMATCH, f"prefill {peer.key[0]}:{peer.key[1]}: {reason}", now)
                return
            old_agent, peer.prefill_agent = peer.prefill_agent, msg.info.agent_name
            peer.registered = True
            if old_agent and old_agent != peer.prefill_agent:
                self._forget_agent(peer, old_agent, now)
            for rec in list(peer.recvs.values()):
                rec.receiver.cell.advance(KVPoll.WaitingForInput)
                if rec.init is not None and rec.sent_at is None:
                    self._send_request(peer, rec, now)
        elif isinstance(msg, RegisterRefused):
            self._drop_peer(peer, FailureCause(msg.cause), msg.reason, now)
        elif isinstance(msg, Pong):
            if peer.prefill_agent and msg.agent_name != peer.prefill_agent:
                self.log.warning("prefill %s:%d restarted (agent %s, was %s): registering anew",
                                 *peer.key, msg.agent_name, peer.prefill_agent)
                self._register_again(peer, now)
                return
            for room in msg.rooms:
                alive = peer.recvs.get(room)
                if alive is not None and alive.sent_at is not None:
                    alive.alive_at = now
        elif isinstance(msg, Status):
            self._on_status(peer, msg, now)

    def _forget_agent(self, peer: _PrefillPeer, old_agent: str, now: float) -> None:
        """The prefill at peer.key acked with a new agent: requests the old one had fail now."""
        why = f"prefill {peer.key[0]}:{peer.key[1]} restarted (agent {old_agent} is gone)"
        for rec in list(peer.recvs.values()):
            if rec.sent_at is not None and rec.sent_to == old_agent:
                self._fail(peer, rec, FailureCause.PEER_LOST, why, now, notify=False)

    def _on_status(self, peer: _PrefillPeer, msg: Status, now: float) -> None:
        rec = peer.recvs.get(msg.room)
        if msg.reregister:
            self._register_again(peer, now)
            if rec is not None and rec.sent_at is not None and not rec.resent:
                rec.sent_at, rec.resent = None, True  # that prefill never saw it: send it after the ack
                rec.receiver.request_sent = False
                return
        if rec is None or rec.sent_at is None:
            for key, drec in self.draining:
                if key == peer.key and drec.receiver.room == msg.room:
                    drec.receiver.drained = True
            return
        receiver = rec.receiver
        if msg.ok:
            row = receiver.aux_row()
            if row is not None and row.room == receiver.room:
                if receiver.cell.advance(KVPoll.Success):
                    self.metrics.completed(self._nbytes(rec), now - rec.sent_at)
            else:
                got = "an empty row" if row is None else f"room {row.room}"
                self.fail(receiver.cell, FailureCause.CORRUPTION, f"aux row check failed: expected room {receiver.room}, found {got}")
        else:
            cause = FailureCause(msg.cause) if msg.cause in FailureCause._value2member_map_ else FailureCause.TRANSFER_ERROR
            self.fail(receiver.cell, cause, f"prefill: {msg.reason}")
        receiver.drained = True
        peer.recvs.pop(msg.room, None)

    def _nbytes(self, rec: _Recv) -> int:
        assert rec.init is not None
        per_page = self.layout.page_bytes * len(self.register_msg.kv_bases)  # every slice's copy of the page
        return per_page * rec.init.dst_pages.size + self.aux.row_bytes

    # ---- periodic work ------------------------------------------------------------------
    @property
    def ping_interval(self) -> float:
        """Pings also carry each room's sign of life: at least three per transfer timeout."""
        return min(self.cfg.heartbeat_interval_s, self.cfg.transfer_timeout_s / 3)

    def tick(self, now: float) -> bool:
        self.endpoint.progress()
        cfg = self.cfg
        busy = False
        for peer in list(self.peers.values()):
            if not peer.registered:
                if now - peer.started > cfg.handshake_timeout_s:
                    why = f"prefill {peer.key[0]}:{peer.key[1]} did not answer the handshake within {cfg.handshake_timeout_s:.1f}s"
                    if self.security is not None and self.security.authenticated:
                        why += " (or it does not hold this cluster's secret)"
                    self._drop_peer(peer, FailureCause.HANDSHAKE, why, now)
                continue
            if now - peer.last_seen > cfg.heartbeat_timeout_s:
                why = f"lost prefill {peer.key[0]}:{peer.key[1]}: no heartbeat for {now - peer.last_seen:.1f}s"
                self._drop_peer(peer, FailureCause.PEER_LOST, why, now)
                continue
            if now - peer.last_ping >= self.ping_interval:
                peer.last_ping = now
                waiting = [room for room, rec in peer.recvs.items() if rec.sent_at is None]
                self._send(peer, Ping(next(self._ping_seq), waiting))
            for rec in list(peer.recvs.values()):
                if rec.sent_at is None:
                    continue
                busy = True
                silent = now - max(rec.sent_at, rec.alive_at)
                if silent > cfg.transfer_timeout_s:
                    why = f"transfer timeout: no status or sign of life of the room from prefill for {silent:.1f}s"
                    self._fail(peer, rec, FailureCause.TRANSFER_TIMEOUT, why, now, notify=True)
        keep = []
        for key, rec in self.draining:
            deadline = rec.receiver.drain_deadline
            if deadline is not None and now >= deadline:
                rec.receiver.drained = True
            if not rec.receiver.drained:
                keep.append((key, rec))
        self.draining = keep
        return busy

    def shutdown(self) -> None:
        now = time.monotonic()
        for peer in list(self.peers.values()):
            for rec in list(peer.recvs.values()):
                self._fail(peer, rec, FailureCause.SHUTDOWN, "decode KVManager shut down", now, notify=True)
            self.poller.unregister(peer.sock)
            peer.sock.close(linger=0)
        self.peers.clear()

    def check_integrity(self) -> None:
        for peer in self.peers.values():
            for room, rec in peer.recvs.items():
                assert rec.receiver.room == room, "receiver filed under the wrong room (bug)"
