"""Prefill half of the manager thread: registrations, per-room WRITE pipeline, timeouts.

Runs only in the KVManager's background thread. Per room:

    create_sender ──> (TransferRequest from decode) ──> WaitingForInput
    SendCmd* ──> post KV WRITEs (one descriptor per coalesced page run, all layers; one handle per send)
    last SendCmd ──> write our aux row, post its WRITE
    all handles DONE ──> Status(ok) to decode ──> Success
    any failure/abort ──> stop posting, let posted handles settle ──> Status(failed) (= drain ack)

Tensor parallelism: slice i of `slices` is TP rank i's KV, registered by that rank's own agent.
Each send posts one WRITE per (source rank, destination rank) pair of head ranges, from the
source rank's agent (rank 0: this endpoint; rank r: its RankAgent through `link`) to the
destination rank's agent; a room succeeds only when every rank's WRITEs are DONE (a rank
reports a post only once it settled). The aux row goes from rank 0 to decode rank 0.
"""

from __future__ import annotations

import dataclasses
import hmac
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from common.cache.kv_pool import KVLayout
from kv_transfer.aux_buffer import AuxBuffer, AuxRow, AuxSlotAllocator
from kv_transfer.base import FailureCause, KVPoll, TransferConfig
from kv_transfer.descriptors import DescArrays, coalesce_pages
from kv_transfer.endpoint import EndpointError, PostedXfer, TransferEndpoint
from kv_transfer.faults import FaultInjector
from kv_transfer.handles import AbortCmd, KVSender, SendCmd
from kv_transfer.head_slices import (
    HeadPair,
    HeadSlice,
    build_sliced_descs,
    concat_descs,
    pair_slices,
    slices_from_wire,
    split_compatible,
    total_heads,
)
from kv_transfer.messages import (
    Abort,
    ControlMsg,
    InfoQuery,
    Ping,
    Pong,
    PrefillInfo,
    Register,
    RegisterAck,
    RegisterRefused,
    Status,
    TransferRequest,
)
from kv_transfer.rank_link import RankLink
from kv_transfer.side import Side, layout_from_wire


@dataclass
class _DecodePeer:
    identity: bytes
    reg: Register
    nixl_name: str  # decode rank 0's agent (the aux row's target)
    last_seen: float
    pairs: list[tuple[HeadSlice, HeadSlice, HeadPair]]  # which of our slices writes which heads of theirs
    agents: list[str] = field(default_factory=list)  # agent of each of their slices (TP rank r: slice r)


@dataclass
class _EarlyRequest:
    """A TransferRequest that came before its sender: page ids kept compact (int32)."""

    identity: bytes
    dst_pages: np.ndarray
    aux_slot: int
    skip_pages: int
    at: float


@dataclass
class _Tombstone:
    cause: FailureCause
    reason: str
    at: float


@dataclass
class _Room:
    sender: KVSender
    created: float
    peer: _DecodePeer | None = None
    dst_pages: np.ndarray | None = None
    dst_aux: int = -1
    next_dst: int = 0
    pending: deque[SendCmd] = field(default_factory=deque)
    outstanding: list[PostedXfer] = field(default_factory=list)
    last_posted: bool = False
    src_aux: int | None = None
    first_post: float | None = None
    nbytes: int = 0
    failed_at: float | None = None
    ndescs: int = 0
    post_s: float = 0.0  # summed over its handles
    wire_s: float = 0.0  # summed over its KV handles: posted -> DONE
    progress_at: float = 0.0  # its last WRITE posted or DONE
    waited_at: float = 0.0  # decode's last mention of it in a Ping (its prealloc queue holds it)


def memory_type_mismatch(prefill_mem_type: str, decode_mem_type: str) -> str | None:
    """A WRITE names one memory type for both ends: KV pools on different kinds of memory
    (one role on a GPU, the other on CPU) would pass the handshake and fail every transfer."""
    if prefill_mem_type == decode_mem_type:
        return None
    where = {"VRAM": "GPU memory (VRAM)", "DRAM": "host memory (DRAM)"}
    return (
        f"KV memory type mismatch: prefill's KV pool is in {where.get(prefill_mem_type, prefill_mem_type)}, "
        f"decode's in {where.get(decode_mem_type, decode_mem_type)}; run both roles on the same --device kind"
    )


class PrefillSide(Side):
    def __init__(
        self,
        *,
        cfg: TransferConfig,
        layout: KVLayout,
        endpoint: TransferEndpoint,
        slices: list[HeadSlice],
        aux: AuxBuffer,
        info: PrefillInfo,
        faults: FaultInjector,
        link: RankLink | None = None,
        **kw: object,
    ) -> None:
        super().__init__(cfg=cfg, endpoint=endpoint, **kw)  # type: ignore[arg-type]
        self.layout = layout
        self.slices = slices
        self.link = link  # TP > 1: the agents of ranks 1..N-1 (slices[1:])
        self.own_descs = self.own_bytes = 0  # KV WRITEs rank 0's agent posted (its own heads)
        self.aux = aux
        self.aux_slots = AuxSlotAllocator(aux.num_slots)
        self.info = info
        self.faults = faults
        self.rooms: dict[int, _Room] = {}
        self.early: dict[int, _EarlyRequest] = {}
        self.tombstones: dict[int, _Tombstone] = {}
        self.peers: dict[bytes, _DecodePeer] = {}

    # ---- scheduler commands -------------------------------------------------------------
    def create(self, sender: KVSender) -> None:
        now = time.monotonic()
        if sender.room in self.rooms:
            self.fail(sender.cell, FailureCause.DUPLICATE_ROOM, f"room {sender.room} already has a live sender")
            return
        if sender.room in self.tombstones:
            stone = self.tombstones.pop(sender.room)
            self.fail(sender.cell, stone.cause, stone.reason)
            return
        room = _Room(sender, now)
        self.rooms[sender.room] = room
        if sender.room in self.early:
            self._attach(room, self.early.pop(sender.room))

    def command(self, cmd: object) -> None:
        if isinstance(cmd, SendCmd):
            room = self.rooms.get(cmd.sender.room)
            if room is not None and room.sender is cmd.sender and room.failed_at is None:
                room.pending.append(cmd)  # posted by tick(): control messages get a turn between posts
        elif isinstance(cmd, AbortCmd):
            room = self.rooms.get(cmd.handle.room)
            if room is not None and room.sender is cmd.handle:
                self._room_failed(room, FailureCause.ABORTED, cmd.reason)

    # ---- control messages ---------------------------------------------------------------
    def on_message(self, identity: bytes, msg: ControlMsg) -> None:
        now = time.monotonic()
        peer = self.peers.get(identity)
        if peer is not None:
            peer.last_seen = now
        if isinstance(msg, Register):
            self._on_register(identity, msg, now)
        elif isinstance(msg, InfoQuery):
            self.reply(identity, RegisterAck(self.info))
        elif isinstance(msg, Ping):
            if peer is not None:
                self._decode_waits(msg.rooms, now)
            self.reply(identity, Pong(msg.seq, self.endpoint.name, self.live_rooms(identity, now)))
        elif isinstance(msg, TransferRequest):
            self._on_transfer_request(identity, msg, now)
        elif isinstance(msg, Abort):
            self._on_abort(identity, msg, now)

    def _on_register(self, identity: bytes, msg: Register, now: float) -> None:
        reason = None
        cause = FailureCause.LAYOUT_MISMATCH
        if msg.protocol_version != self.info.protocol_version:
            reason = f"protocol version {msg.protocol_version} != {self.info.protocol_version}"
        else:
            remote = layout_from_wire(msg.layout)
            try:
                theirs = slices_from_wire(msg.head_slices, msg.kv_bases, remote, msg.kv_devices or None)
                if msg.rank_agents and len(msg.rank_agents) != len(theirs) - 1:
                    raise ValueError(f"{len(msg.rank_agents)} TP rank agents for {len(theirs)} slices")
            except ValueError as e:
                theirs, reason = [], f"decode sent inconsistent KV buffers: {e}"
            if reason is None:
                reason = split_compatible(self.layout, total_heads(self.slices), remote, total_heads(theirs))
        if reason is None and msg.aux_row_bytes != self.aux.row_bytes:
            reason = f"aux row bytes {msg.aux_row_bytes} != {self.aux.row_bytes}"
        if reason is None:
            reason = memory_type_mismatch(self.endpoint.kv_mem_type, msg.kv_mem_type)
        if reason is None:
            reason = self._admit(identity, msg)
        if reason is None:
            added: list[str] = []
            try:
                for md in (msg.agent_metadata, *msg.rank_agents):
                    added.append(self.endpoint.add_peer(md))
            except EndpointError as e:
                for name in added:
                    self.endpoint.remove_peer(name)
                reason, cause = str(e), FailureCause.HANDSHAKE
            else:
                if self.link is not None:
                    self.link.add_peer([msg.agent_metadata, *msg.rank_agents])
                pairs = [(self.slices[p.src], theirs[p.dst], p) for p in pair_slices(self.slices, theirs)]
                agents = added if msg.rank_agents else added * len(theirs)  # one agent holding every slice
                self.peers[identity] = _DecodePeer(identity, msg, added[0], now, pairs, agents)
                self.reply(identity, RegisterAck(self.info))
                return
        self.log.warning("refused decode %s: %s", msg.agent_name, reason)
        self.reply(identity, RegisterRefused(f"prefill refused registration: {reason}", cause.value))

    def _admit(self, identity: bytes, msg: Register) -> str | None:
        """Why this Register may not (re)place a registration, or None after making room for it.

        A peer is keyed by its connection; a Register naming an agent already registered on
        another connection replaces it only with that registration's instance token (the same
        decode after a reconnect), never on the name alone."""
        for old in [p for p in self.peers.values() if p.reg.agent_name == msg.agent_name and p.identity != identity]:
            if not hmac.compare_digest(old.reg.instance_token, msg.instance_token):
                return f"agent {msg.agent_name} is already registered by another decode"
            self._drop_peer(old, FailureCause.PEER_LOST, "decode re-registered")
        old_self = self.peers.get(identity)
        if old_self is not None:
            self._drop_peer(old_self, FailureCause.PEER_LOST, "decode re-registered")
        if len(self.peers) >= self.cfg.max_peers:
            return f"too many decode peers ({self.cfg.max_peers})"
        return None

    def _decode_waits(self, rooms: list[int], now: float) -> None:
        """A registered decode still queues these rooms for memory before it sends their page
        ids: the bootstrap timeout counts from this last mention (the mirror of live_rooms)."""
        for rid in rooms:
            room = self.rooms.get(rid)
            if room is not None and room.peer is None:
                room.waited_at = now

    def live_rooms(self, identity: bytes, now: float) -> list[int]:
        """The rooms of decode `identity` this prefill still looks after: their request waits
        here for its engine (early), or the engine polled it within transfer_timeout_s (one
        forward of a big batch on a loaded CPU takes tens of seconds) and it has no WRITE
        outstanding without progress for heartbeat_timeout_s (a stalled link is not alive).
        Decode counts its transfer deadline from a room's last mention, so a long prefill
        queue never reads as a stalled transfer while a hung engine or link still does."""
        cfg = self.cfg
        engine_bound = cfg.engine_bound_s
        rooms = [rid for rid, e in self.early.items() if e.identity == identity]
        for rid, room in self.rooms.items():
            if room.peer is None or room.peer.identity != identity or room.failed_at is not None:
                continue
            if now - room.sender.watched_at > engine_bound:
                continue
            if room.outstanding and now - room.progress_at > cfg.heartbeat_timeout_s:
                continue
            rooms.append(rid)
        return rooms

    def _early_pages(self, identity: bytes) -> int:
        return sum(e.dst_pages.size for e in self.early.values() if e.identity == identity)

    def _on_transfer_request(self, identity: bytes, msg: TransferRequest, now: float) -> None:
        peer = self.peers.get(identity)
        if peer is None:
            self.reply(identity, Status(msg.room, False, "decode not registered here", "handshake", reregister=True))
            return
        bad = None
        num_pages = peer.reg.layout.num_pages
        if not msg.dst_pages or len(msg.dst_pages) > num_pages or min(msg.dst_pages) < 0 or max(msg.dst_pages) >= num_pages:
            bad = "dst page ids out of the decode pool's range"
        elif not 0 <= msg.aux_slot < peer.reg.aux_slots:
            bad = f"dst aux slot {msg.aux_slot} out of range"
        elif msg.skip_pages < 0:
            bad = f"skip_pages {msg.skip_pages} < 0"
        if bad is not None:
            self.reply(identity, Status(msg.room, False, bad, FailureCause.BAD_REQUEST.value))
            return
        if msg.room in self.tombstones:
            stone = self.tombstones[msg.room]
            self.reply(identity, Status(msg.room, False, stone.reason, stone.cause.value))
            return
        room = self.rooms.get(msg.room)
        if (room is not None and room.peer is not None) or (room is None and msg.room in self.early):
            why = f"duplicate room {msg.room}: another decode already claimed it"
            self.reply(identity, Status(msg.room, False, why, FailureCause.DUPLICATE_ROOM.value))
            return
        early = _EarlyRequest(identity, np.asarray(msg.dst_pages, dtype=np.int32), msg.aux_slot, msg.skip_pages, now)
        if room is not None:
            self._attach(room, early)
            return
        full = None
        if len(self.early) >= self.cfg.max_early_requests:
            full = f"prefill holds {self.cfg.max_early_requests} transfer requests for unknown rooms"
        elif self._early_pages(identity) + early.dst_pages.size > num_pages:
            full = "transfer requests for unknown rooms name more pages than the decode pool has"
        if full is not None:
            self.reply(identity, Status(msg.room, False, full, FailureCause.BAD_REQUEST.value))
            return
        self.early[msg.room] = early

    def _bury(self, room: int, cause: FailureCause, reason: str, now: float) -> None:
        while len(self.tombstones) >= self.cfg.max_tombstones:
            del self.tombstones[next(iter(self.tombstones))]  # oldest first
        self.tombstones[room] = _Tombstone(cause, reason, now)

    def _on_abort(self, identity: bytes, msg: Abort, now: float) -> None:
        if identity not in self.peers:
            self.reply(identity, Status(msg.room, False, "decode not registered here", "handshake", reregister=True))
            return
        msg = Abort(msg.room, msg.reason[: self.cfg.max_reason_chars])
        room = self.rooms.get(msg.room)
        if room is not None and (room.peer is None or room.peer.identity == identity):
            self._room_failed(room, FailureCause.ABORTED, f"aborted by decode: {msg.reason}")
            if room.peer is None:
                self.reply(identity, Status(msg.room, False, "aborted by decode", FailureCause.ABORTED.value))
            return
        early = self.early.get(msg.room)
        if early is not None and early.identity == identity:
            del self.early[msg.room]
        if room is None:
            self._bury(msg.room, FailureCause.ABORTED, f"aborted by decode: {msg.reason}", now)
        self.reply(identity, Status(msg.room, False, "aborted by decode", FailureCause.ABORTED.value))

    def _attach(self, room: _Room, req: _EarlyRequest) -> None:
        room.peer = self.peers.get(req.identity)
        if room.peer is None:
            self._room_failed(room, FailureCause.PEER_LOST, "decode peer vanished before the transfer")
            return
        room.dst_pages = req.dst_pages.astype(np.int64)
        room.dst_aux = req.aux_slot
        room.sender.num_dst_pages = int(req.dst_pages.size)
        room.sender.skip_pages = req.skip_pages
        room.sender.cell.advance(KVPoll.WaitingForInput)

    # ---- the WRITE pipeline -------------------------------------------------------------
    def _pump(self, room: _Room) -> None:
        """Post the oldest pending send of `room` (one per tick)."""
        if room.pending and room.failed_at is None:
            cmd = room.pending[0]
            if cmd.is_last and room.src_aux is None:
                room.src_aux = self.aux_slots.alloc()
                if room.src_aux is None:
                    return  # retried on the next tick
            assert room.peer is not None and room.dst_pages is not None, "send before attach (bug)"
            if cmd.pages.size and (cmd.pages.min() < 0 or cmd.pages.max() >= self.layout.num_pages):
                self._room_failed(room, FailureCause.BAD_REQUEST, "src page id out of the prefill pool's range")
                return
            try:
                self._post_kv(room, room.peer, room.dst_pages, cmd.pages)
                if cmd.is_last:
                    assert cmd.aux is not None, "last send without aux (bug)"
                    self._post_aux(room, room.peer, cmd.aux)
            except EndpointError as e:
                self._room_failed(room, FailureCause.TRANSFER_ERROR, str(e))
                if not e.injected:
                    self._drop_peer(room.peer, FailureCause.TRANSFER_ERROR, f"NIXL error towards decode: {e}")
                return
            room.pending.popleft()
            room.progress_at = time.monotonic()

    def _post_kv(self, room: _Room, peer: _DecodePeer, dst_pages: np.ndarray, pages: np.ndarray) -> None:
        if pages.size == 0:
            return
        dst = dst_pages[room.next_dst : room.next_dst + pages.size]
        runs = coalesce_pages(pages, dst)
        if room.first_post is None:
            room.first_post = time.monotonic()
        by_route: dict[tuple[int, str], list[DescArrays]] = {}  # (source rank, destination agent)
        for src, dst_slice, pair in peer.pairs:
            by_route.setdefault((pair.src, peer.agents[pair.dst]), []).append(
                build_sliced_descs(runs, self.layout, src, dst_slice, pair))
        for (rank, agent), parts in by_route.items():
            descs = concat_descs(parts)
            xfer = self._post_write(rank, descs, agent)
            room.outstanding.append(xfer)
            room.nbytes += descs.nbytes
            room.ndescs += xfer.ndescs
            self.metrics.posted(descs.nbytes, xfer.ndescs)
        room.next_dst += pages.size

    def _post_write(self, rank: int, descs: DescArrays, agent: str) -> PostedXfer:
        """One WRITE from TP rank `rank`'s agent (its own slice) to `agent`."""
        if rank == 0:
            xfer = self.endpoint.post_write(descs.local, descs.remote, self.endpoint.kv_mem_type, agent, descs.nbytes)
            self.own_descs += xfer.ndescs
            self.own_bytes += descs.nbytes
            return xfer
        assert self.link is not None, "a source slice of another rank without a link (bug)"
        return self.link.post_write(rank, descs.local, descs.remote, self.endpoint.kv_mem_type, agent, descs.nbytes)

    def _is_done(self, xfer: PostedXfer, inject: bool) -> bool:
        if xfer.rank == 0 or self.link is None:
            return self.endpoint.is_done(xfer, inject=inject)
        return self.link.is_done(xfer, inject=inject)

    def _release(self, xfer: PostedXfer) -> None:
        if xfer.rank == 0 or self.link is None:
            self.endpoint.release(xfer)
        else:
            self.link.release(xfer)

    def _post_aux(self, room: _Room, peer: _DecodePeer, aux: AuxRow) -> None:
        assert room.src_aux is not None
        self.aux.write_row(room.src_aux, dataclasses.replace(aux, room=room.sender.room))
        rb = self.aux.row_bytes
        local = np.array([[self.endpoint.aux_base + room.src_aux * rb, rb, 0]], dtype=np.uint64)
        remote = np.array([[peer.reg.aux_base + room.dst_aux * rb, rb, 0]], dtype=np.uint64)
        if room.first_post is None:
            room.first_post = time.monotonic()
        xfer = self.endpoint.post_write(local, remote, "DRAM", peer.nixl_name, rb)
        xfer.is_aux = True
        room.outstanding.append(xfer)
        room.nbytes += rb
        room.ndescs += 1
        self.metrics.posted(rb, 1)
        room.last_posted = True

    def _room_failed(self, room: _Room, cause: FailureCause, reason: str) -> None:
        self.fail(room.sender.cell, cause, reason)
        if room.failed_at is None:
            room.failed_at = time.monotonic()
            room.pending.clear()

    def _drop_peer(self, peer: _DecodePeer, cause: FailureCause, reason: str) -> None:
        if self.peers.get(peer.identity) is not peer:
            return  # already dropped (a settling transfer of its rooms may raise again)
        self.peers.pop(peer.identity)
        names = list(dict.fromkeys(peer.agents or [peer.nixl_name]))
        for name in names:
            self.endpoint.remove_peer(name)
        if self.link is not None:
            self.link.drop_peer(names)
        for room in self.rooms.values():
            if room.peer is peer:
                self._room_failed(room, cause, reason)

    # ---- periodic work ------------------------------------------------------------------
    def check_peers(self, now: float) -> None:
        """Drop decode peers silent past the heartbeat timeout. Runs before this thread reads
        queued messages and before it posts: after a long stall (SIGSTOP, starvation) a peer
        that may have given up and reused the pages gets no late WRITE."""
        for peer in list(self.peers.values()):
            if now - peer.last_seen > self.cfg.heartbeat_timeout_s:
                self._drop_peer(peer, FailureCause.PEER_LOST, f"decode {peer.reg.agent_name} silent for {now - peer.last_seen:.1f}s")

    def tick(self, now: float) -> bool:
        self.check_peers(now)
        for room in list(self.rooms.values()):
            self._progress(room, now)
        cfg = self.cfg
        for rid, early in list(self.early.items()):
            if now - early.at > cfg.bootstrap_timeout_s:
                del self.early[rid]
                why = "prefill never received this request"
                self.reply(early.identity, Status(rid, False, why, FailureCause.BOOTSTRAP_TIMEOUT.value))
        while self.tombstones:  # buried in time order
            rid = next(iter(self.tombstones))
            if now - self.tombstones[rid].at <= cfg.bootstrap_timeout_s:
                break
            del self.tombstones[rid]
        return any(r.outstanding or r.pending for r in self.rooms.values())

    def _progress(self, room: _Room, now: float) -> None:
        self._pump(room)  # first, so a WRITE that completes at once finishes in this tick
        still = []
        for xfer in room.outstanding:
            try:
                done = self._is_done(xfer, room.failed_at is None)
            except EndpointError as e:
                self._room_failed(room, FailureCause.TRANSFER_ERROR, str(e))
                if e.terminal:
                    self._release(xfer)
                else:  # its writes may still land: decode hears of the failure once they settled
                    still.append(xfer)
                if room.peer is not None and not e.injected:
                    self._drop_peer(room.peer, FailureCause.TRANSFER_ERROR, f"NIXL error towards decode: {e}")
                continue
            if done:
                room.progress_at = now
                self._handle_done(room, xfer)
                self._release(xfer)
            else:
                still.append(xfer)
        room.outstanding = still
        if room.failed_at is not None:
            if room.outstanding and now - room.failed_at < self.cfg.settle_timeout_s:
                return
            for xfer in room.outstanding:
                self._release(xfer)
            self._finish(room, ok=False)
        elif room.last_posted and not room.outstanding and not room.pending:
            self._finish(room, ok=True)
        elif now - room.sender.watched_at > self.cfg.engine_bound_s:
            why = (f"prefill's engine has not looked after this request for {now - room.sender.watched_at:.1f}s "
                   f"(hung: past {self.cfg.engine_bound_s:.1f}s)")
            self._room_failed(room, FailureCause.TRANSFER_TIMEOUT, why)
        elif room.peer is None and now - max(room.created, room.waited_at) > self.cfg.bootstrap_timeout_s:
            why = (f"bootstrap timeout: decode sent no page ids and did not mention the room for "
                   f"{self.cfg.bootstrap_timeout_s:.1f}s")
            self._room_failed(room, FailureCause.BOOTSTRAP_TIMEOUT, why)

    def _handle_done(self, room: _Room, xfer: PostedXfer) -> None:
        """NIXL said DONE just now (the tick's `now` may predate the post)."""
        wire_s = max(0.0, time.monotonic() - xfer.posted_at) if xfer.posted_at else 0.0
        room.post_s += xfer.post_s
        if not xfer.is_aux:
            room.wire_s += wire_s
        self.metrics.handle_done(xfer.nbytes, xfer.post_s, wire_s, kv=not xfer.is_aux)

    def _finish(self, room: _Room, *, ok: bool) -> None:
        del self.rooms[room.sender.room]
        if room.src_aux is not None:
            self.aux_slots.free(room.src_aux)
        cell = room.sender.cell
        if ok:
            status = Status(room.sender.room, True)
        else:
            status = Status(room.sender.room, False, cell.reason or "failed", (cell.cause or FailureCause.ABORTED).value)
            if room.peer is None:
                self._bury(room.sender.room, cell.cause or FailureCause.ABORTED, cell.reason or "failed", time.monotonic())
        if room.peer is not None:
            if not (ok and self.faults.drop_status()):
                self.reply(room.peer.identity, status)
        if ok and cell.advance(KVPoll.Success):
            latency = time.monotonic() - (room.first_post or room.created)
            self.metrics.completed(room.nbytes, latency, room.ndescs)
            kv_bytes = room.nbytes - self.aux.row_bytes
            gbps = kv_bytes / room.wire_s / 1e9 if room.wire_s > 0 else 0.0
            self.log.info(
                "kv sent room=%d rid=%s bytes=%d descriptors=%d post_ms=%.3f wire_ms=%.3f wire_gbps=%.2f latency_ms=%.3f",
                room.sender.room, room.sender.rid, room.nbytes, room.ndescs, room.post_s * 1e3, room.wire_s * 1e3, gbps,
                latency * 1e3,
            )

    def shutdown(self) -> None:
        for room in list(self.rooms.values()):
            self._room_failed(room, FailureCause.SHUTDOWN, "prefill KVManager shut down")
            for xfer in room.outstanding:
                self._release(xfer)
            room.outstanding.clear()
            self._finish(room, ok=False)

    def check_integrity(self) -> None:
        used = {r.src_aux for r in self.rooms.values() if r.src_aux is not None}
        assert self.aux_slots.num_free + len(used) == self.aux.num_slots, "prefill aux slots leaked"
        self.aux_slots.check_integrity()
