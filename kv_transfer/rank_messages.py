"""Messages between a TP instance's rank 0 KVManager and the transfer agents of ranks 1..N-1.

    rank r DEALER (RankAgent)                      rank 0 ROUTER (RankLink, ipc, in its KVManager)
      RankHello{agent md, its KV slice} -------->  (once, before the ranks' start barrier)
                 <--- RankAddPeer{decode agents' md}   prefill: a decode registered
                 <--- RankDropPeer{agent names}        prefill: a decode was dropped
                 <--- RankPost{seq, descriptors}       prefill: WRITE this rank's heads of a room
      RankDone{seq, ok, descs, bytes} ---------->      the post settled (DONE, or failed)
                 <--- RankPace{busy}                   decode: progress fast (transfers in flight)

Every rank's agent registers only its own KV slice; descriptors of a RankPost address that
slice locally and a decode rank's slice remotely (kv_transfer/head_slices.py).
"""

from __future__ import annotations

import msgspec


class RankHello(msgspec.Struct, frozen=True, array_like=True, tag="hello"):
    rank: int
    agent_name: str
    agent_metadata: bytes
    kv_mem_type: str
    kv_device: int
    head_start: int
    bases: list[int]  # [the base of its page-major KV pool]
    registered_bytes: int  # what this rank's agent registered: its own slice only


class RankAddPeer(msgspec.Struct, frozen=True, array_like=True, tag="add"):
    metadata: list[bytes]


class RankDropPeer(msgspec.Struct, frozen=True, array_like=True, tag="drop"):
    agent_names: list[str]


class RankPost(msgspec.Struct, frozen=True, array_like=True, tag="post"):
    seq: int
    peer_agent: str
    local: bytes  # uint64 [n, 3] (addr, len, dev): inside this rank's registered slice
    remote: bytes
    mem_type: str
    nbytes: int


class RankDone(msgspec.Struct, frozen=True, array_like=True, tag="done"):
    seq: int
    ok: bool
    reason: str = ""
    injected: bool = False
    ndescs: int = 0
    nbytes: int = 0


class RankPace(msgspec.Struct, frozen=True, array_like=True, tag="pace"):
    busy: bool


ToRank = RankAddPeer | RankDropPeer | RankPost | RankPace
FromRank = RankHello | RankDone

_ENCODER = msgspec.msgpack.Encoder()
_TO_RANK = msgspec.msgpack.Decoder(ToRank)
_FROM_RANK = msgspec.msgpack.Decoder(FromRank)


def encode(msg: ToRank | FromRank) -> bytes:
    return _ENCODER.encode(msg)


def decode_to_rank(data: bytes) -> ToRank:
    return _TO_RANK.decode(data)


def decode_from_rank(data: bytes) -> FromRank:
    return _FROM_RANK.decode(data)
