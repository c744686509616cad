"""Rank 0's end of a TP instance's transfer agents (one RankAgent per rank 1..N-1).

Lives in rank 0's KVManager and is driven by its background thread only (after the hellos):

    link = RankLink(addr, ctx); link.wait_hellos(n - 1, timeout)   each rank's agent and KV slice
    link.post_write(rank, local, remote, mem_type, agent, nbytes)  -> PostedXfer(rank=rank)
    link.is_done(xfer) / release(xfer)                             as TransferEndpoint's
    link.on_readable()                                             RankDone reports
    link.add_peer(metadata) / drop_peer(names) / pace(busy)

A rank reports a post only once it settled (its WRITEs DONE, or failed and drained), so a
failed report is terminal. A rank that dies takes the instance down (tp_ranks.py): its posts
stay pending until the room's own timeouts, or the engine, end them.

A message counts only from its rank's own connection (ROUTER routing id = the rank, one hello
each); the socket sits in the instance's 0700 directory (tp_ranks.py), so no other user connects.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
import zmq

from kv_transfer.endpoint import EndpointError, PostedXfer
from kv_transfer.rank_messages import (
    RankAddPeer,
    RankDone,
    RankDropPeer,
    RankHello,
    RankPace,
    RankPost,
    ToRank,
    decode_from_rank,
    encode,
)
from kv_transfer.side import log


@dataclass
class RankStats:
    registered_bytes: int
    descriptors: int = 0  # posted by that rank's agent and reported DONE
    bytes: int = 0
    failed_posts: int = 0


def _text(name: str | bytes) -> str:
    """NIXL hands agent names back as bytes; the wire carries text."""
    return name if isinstance(name, str) else name.decode()


class RankLink:
    def __init__(self, addr: str, ctx: zmq.Context, send_hwm: int = 10000) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, send_hwm)
        self.sock.bind(addr)
        self.hellos: dict[int, RankHello] = {}
        self.stats: dict[int, RankStats] = {}
        self._seq = itertools.count(1)
        self._pending: dict[int, int] = {}  # seq -> rank
        self._results: dict[int, RankDone] = {}
        self._busy = False
        self.refused = 0  # messages dropped because they came from the wrong connection
        self._ranks = 0  # ranks 1.._ranks may say hello (wait_hellos)

    def wait_hellos(self, n: int, timeout_s: float) -> list[RankHello]:
        """Ranks 1..n, each with its agent and KV slice (sent before the ranks' start barrier)."""
        deadline = time.monotonic() + timeout_s
        self._ranks = n
        while len(self.hellos) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000))):
                raise RuntimeError(f"TP ranks' transfer agents: {len(self.hellos)} of {n} said hello within {timeout_s}s")
            self._read()
        return [self.hellos[r] for r in sorted(self.hellos)]

    def on_readable(self, _sock: object = None) -> None:
        self._read()

    def _read(self) -> None:
        for _ in range(1000):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = decode_from_rank(frames[-1])
            sender = frames[0] if len(frames) > 1 else b""
            if isinstance(msg, RankHello):
                if sender != str(msg.rank).encode() or msg.rank in self.hellos or not 1 <= msg.rank <= self._ranks:
                    self._refuse(sender, f"hello as rank {msg.rank}")
                    continue
                self.hellos[msg.rank] = msg
                self.stats[msg.rank] = RankStats(msg.registered_bytes)
            elif msg.seq in self._pending:
                rank = self._pending[msg.seq]
                if sender != str(rank).encode():  # only the rank the post went to reports it
                    self._refuse(sender, f"report of rank {rank}'s post {msg.seq}")
                    continue
                st = self.stats[rank]
                if msg.ok:
                    st.descriptors += msg.ndescs
                    st.bytes += msg.nbytes
                else:
                    st.failed_posts += 1
                self._results[msg.seq] = msg

    def _refuse(self, sender: bytes, what: str) -> None:
        self.refused += 1
        log.warning("TP link: dropped a %s from connection %r (not that rank's)", what, sender[:16])

    def _send(self, rank: int, msg: ToRank) -> None:
        try:
            self.sock.send_multipart([str(rank).encode(), encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("message to TP rank %d dropped: %s", rank, e)

    def post_write(self, rank: int, local: np.ndarray, remote: np.ndarray, mem_type: str, peer: str | bytes,
                   nbytes: int) -> PostedXfer:
        seq = next(self._seq)
        self._pending[seq] = rank
        self._send(rank, RankPost(seq, _text(peer), np.ascontiguousarray(local, dtype=np.uint64).tobytes(),
                                  np.ascontiguousarray(remote, dtype=np.uint64).tobytes(), mem_type, nbytes))
        return PostedXfer(seq, nbytes, len(local), rank=rank, posted_at=time.monotonic())  # post -> done includes the hop

    def is_done(self, xfer: PostedXfer, *, inject: bool = True) -> bool:
        res = self._results.pop(xfer.handle, None)
        if res is None:
            return False
        self._pending.pop(xfer.handle, None)
        if not res.ok:
            raise EndpointError(res.reason, injected=res.injected, terminal=True)
        return True

    def release(self, xfer: PostedXfer) -> None:
        """Forget a post (a late report of it is dropped)."""
        self._pending.pop(xfer.handle, None)
        self._results.pop(xfer.handle, None)

    def add_peer(self, metadata: list[bytes]) -> None:
        """Every rank's agent adds these decode agents (in order behind earlier messages)."""
        for rank in self.hellos:
            self._send(rank, RankAddPeer(metadata))

    def drop_peer(self, agent_names: list[str] | list[bytes]) -> None:
        for rank in self.hellos:
            self._send(rank, RankDropPeer([_text(n) for n in agent_names]))

    def pace(self, busy: bool) -> None:
        """Decode: the ranks' agents progress fast while transfers are in flight."""
        if busy != self._busy:
            self._busy = busy
            for rank in self.hellos:
                self._send(rank, RankPace(busy))

    def rank_stats(self, moves: bool = True) -> dict[str, int]:
        """{rank{r}_registered_bytes, and with `moves` (prefill) _descriptors, _bytes, _failed_posts}."""
        out = {}
        for rank, st in sorted(self.stats.items()):
            for key, value in vars(st).items():
                if moves or key == "registered_bytes":
                    out[f"rank{rank}_{key}"] = value
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
