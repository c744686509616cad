"""The KV transfer agent of TP rank r > 0: its own NIXL agent over its own KV slice.

    RankAgent(RankAgentArgs(...))    in the rank process, before the ranks' start barrier:
                                     registers this rank's K/V buffers (nothing else), sends
                                     RankHello to rank 0's KVManager (kv_transfer/rank_link.py)
    background thread (daemon)       prefill: adds decode agents, posts the WRITEs rank 0 hands
                                     it, reports each one settled (RankDone); decode: drives the
                                     agent's progress as a WRITE target (fast while rank 0 says
                                     transfers are in flight, else every idle_poll_s)

Rank 0 owns rooms, timeouts and the control channel to the other instance; this agent only
moves bytes. It ends with its process (rank 0 gone ends the rank, tp_rank_process.py). Rank 0
decides which posts exist; the agent checks that their local descriptors lie inside its own
registered slice (the heads it holds) before posting.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import zmq

from kv_transfer.base import TransferConfig
from kv_transfer.endpoint import EndpointError, PostedXfer, TransferEndpoint, make_endpoint
from kv_transfer.faults import FaultInjector, FaultSpec
from kv_transfer.rank_messages import (
    RankAddPeer,
    RankDone,
    RankDropPeer,
    RankHello,
    RankPace,
    RankPost,
    ToRank,
    decode_to_rank,
    encode,
)
from kv_transfer.ucx_env import ucx_pinned_to

log = logging.getLogger("kv_transfer")


@dataclass(frozen=True)
class RankAgentArgs:
    role: str  # "prefill" | "decode"
    rank: int
    link_addr: str  # rank 0's RankLink (ipc://)
    kv_buffer: torch.Tensor  # the rank's page-major KV pool (KVPool.kv)
    kv_head_start: int
    bootstrap_host: str = "127.0.0.1"
    backend: str = "nixl"
    config: TransferConfig = field(default_factory=TransferConfig)


@dataclass
class _Posted:
    seq: int
    xfer: PostedXfer
    failed_at: float | None = None
    reason: str = ""
    injected: bool = False


class RankAgent:
    """on_crash: called (in the agent's thread) when that thread dies of a bug; the rank's
    process should end then (tp_rank_process.py exits), which takes the instance down: rooms
    whose writes this rank holds could otherwise wait for reports that never come."""

    def __init__(self, args: RankAgentArgs, on_crash: Callable[[], None] | None = None) -> None:
        self.args = args
        self._on_crash = on_crash
        self.cfg = args.config
        kv = [args.kv_buffer]
        self.faults = FaultInjector(FaultSpec.parse(self.cfg.faults), rank=args.rank)
        with ucx_pinned_to(args.bootstrap_host):
            self.endpoint: TransferEndpoint = make_endpoint(args.backend, f"{args.role}-tp{args.rank}", kv, None, self.faults)
        self._ranges = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in kv)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, str(args.rank).encode())
        self._sock.connect(args.link_addr)
        self._sock.send(encode(RankHello(
            args.rank, self.endpoint.name, self.endpoint.metadata(), self.endpoint.kv_mem_type, self.endpoint.kv_device,
            args.kv_head_start, [t.data_ptr() for t in kv], sum(hi - lo for lo, hi in self._ranges),
        )))
        self._posted: list[_Posted] = []
        self._busy = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-transfer-tp{args.rank}", daemon=True)
        self._thread.start()
        log.info("TP rank %d %s transfer agent %s up (its own KV slice only)", args.rank, args.role, self.endpoint.name)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self._busy or bool(self._posted)
                timeout = self.cfg.busy_poll_s if busy else self.cfg.idle_poll_s
                if self._sock.poll(max(1, int(timeout * 1000.0))):
                    for _ in range(1000):
                        try:
                            data = self._sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(decode_to_rank(data))
                self.endpoint.progress()
                self._check_posted(time.monotonic())
        except Exception:
            log.exception("TP rank %d transfer agent crashed", self.args.rank)
            if self._on_crash is not None:
                self._on_crash()
            raise

    def _on_message(self, msg: ToRank) -> None:
        if isinstance(msg, RankPost):
            self._post(msg)
        elif isinstance(msg, RankAddPeer):
            for md in msg.metadata:
                try:
                    self.endpoint.add_peer(md)
                except EndpointError as e:  # posts to it fail, which fails their rooms
                    log.warning("TP rank %d could not add a decode agent: %s", self.args.rank, e)
        elif isinstance(msg, RankDropPeer):
            for name in msg.agent_names:
                self.endpoint.remove_peer(name)
        elif isinstance(msg, RankPace):
            self._busy = msg.busy

    def _outside_own_slice(self, local: np.ndarray) -> bool:
        ends = local[:, 0] + local[:, 1]
        inside = np.zeros(len(local), dtype=bool)
        for lo, hi in self._ranges:
            inside |= (local[:, 0] >= lo) & (ends <= hi)
        return not bool(inside.all())

    def _post(self, msg: RankPost) -> None:
        local = np.frombuffer(msg.local, dtype=np.uint64).reshape(-1, 3)
        remote = np.frombuffer(msg.remote, dtype=np.uint64).reshape(-1, 3)
        if len(local) != len(remote) or self._outside_own_slice(local):
            self._done(RankDone(msg.seq, False, f"TP rank {self.args.rank}: descriptors outside its KV slice (bug)"))
            return
        try:
            xfer = self.endpoint.post_write(local, remote, msg.mem_type, msg.peer_agent, msg.nbytes)
        except EndpointError as e:  # nothing posted: no byte lands later
            self._done(RankDone(msg.seq, False, f"TP rank {self.args.rank}: {e}", e.injected))
            return
        self._posted.append(_Posted(msg.seq, xfer))

    def _check_posted(self, now: float) -> None:
        still = []
        for p in self._posted:
            try:
                done = self.endpoint.is_done(p.xfer, inject=p.failed_at is None)
            except EndpointError as e:
                if e.terminal or p.failed_at is not None:
                    self.endpoint.release(p.xfer)
                    self._done(RankDone(p.seq, False, p.reason or f"TP rank {self.args.rank}: {e}", p.injected or e.injected))
                    continue
                p.failed_at, p.reason, p.injected = now, f"TP rank {self.args.rank}: {e}", e.injected
                still.append(p)  # its writes may still land: report once settled
                continue
            if done:
                self.endpoint.release(p.xfer)
                if p.failed_at is None:
                    self._done(RankDone(p.seq, True, ndescs=p.xfer.ndescs, nbytes=p.xfer.nbytes))
                else:
                    self._done(RankDone(p.seq, False, p.reason, p.injected))
            elif p.failed_at is not None and now - p.failed_at > self.cfg.settle_timeout_s:
                self.endpoint.release(p.xfer)
                self._done(RankDone(p.seq, False, p.reason, p.injected))
            else:
                still.append(p)
        self._posted = still

    def _done(self, msg: RankDone) -> None:
        try:
            self._sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # rank 0 gone: this process ends with it
            log.debug("RankDone dropped: %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.cfg.shutdown_timeout_s)
        if not self._thread.is_alive():
            self.endpoint.close()
            self._sock.close(0)
            self._ctx.term()
