"""Control messages between a decode KVManager and a prefill KVManager (ZMQ, msgpack).

    decode DEALER (one per prefill peer)            prefill ROUTER (bootstrap_port)
      (with a cluster secret the socket pair is CURVE: nothing flows before both proved it)
      Register{agent md, buffer bases, layout} --->  add_remote_agent, check layout
                 <--- RegisterAck{PrefillInfo} | RegisterRefused{reason}
      TransferRequest{room, dst pages, aux slot} ->  sender becomes WaitingForInput
      Abort{room, reason} ------------------------>  stop posting, drain
                 <--- Status{room, ok, reason}       after every WRITE of the room is
                                                     DONE (ok) or drained (failed/abort)
      Ping{seq} ---------------------------------->
                 <--- Pong{seq, rooms}                rooms: this decode's rooms prefill still
                                                     looks after (queued, computing, writing
                                                     with progress): decode's transfer
                                                     deadline counts from their last mention
      InfoQuery (bootstrap probe, any client) ---->
                 <--- RegisterAck{PrefillInfo}

Decode treats any Status of a room as "prefill holds no more writes for it".
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 8  # 2: TransferRequest.skip_pages (decode's prefix cache); 3: Register.instance_token;
# 4: head_slices (tensor parallelism: one [first head, heads] per TP rank; bases are per slice);
# 5: one NIXL agent per TP rank (Register.rank_agents, kv_devices; PrefillInfo.rank_agents);
# 6: page-major KV pools (WireLayout.order; Register.kv_bases: one pool base per slice)
# 7: Pong.rooms (per-room sign of life: a long prefill queue is no stalled transfer)
# 8: Ping.rooms (the mirror: a long decode prealloc queue is no lost decode)


class WireLayout(msgspec.Struct, frozen=True, array_like=True):
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    order: str = ""  # KVLayout.order ("" = an older peer: per-layer buffers)


class PrefillInfo(msgspec.Struct, frozen=True, array_like=True):
    """What the bootstrap service publishes: endpoint, agent, layout."""

    protocol_version: int
    agent_name: str
    host: str
    port: int
    layout: WireLayout
    aux_row_bytes: int
    rank: int = 0
    head_slices: list[list[int]] = []  # [first KV head, heads] of each TP rank; [] = one slice of all
    rank_agents: list[str] = []  # agent names of TP ranks 1..N-1 (each writes its own heads)


class Register(msgspec.Struct, frozen=True, array_like=True, tag="reg"):
    protocol_version: int
    agent_name: str
    agent_metadata: bytes
    layout: WireLayout
    kv_bases: list[int]  # one page-major KV pool per slice (TP rank)
    kv_mem_type: str  # "DRAM" | "VRAM"
    kv_device: int
    aux_base: int
    aux_row_bytes: int
    aux_slots: int
    instance_token: bytes  # random per decode manager: only its holder may replace this agent's registration
    head_slices: list[list[int]] = []  # per TP rank [first KV head, heads]
    rank_agents: list[bytes] = []  # agent metadata of TP ranks 1..N-1: slice r lives in rank r's agent
    kv_devices: list[int] = []  # per slice: its GPU (VRAM); [] = kv_device for every slice


class RegisterAck(msgspec.Struct, frozen=True, array_like=True, tag="ack"):
    info: PrefillInfo


class RegisterRefused(msgspec.Struct, frozen=True, array_like=True, tag="refused"):
    reason: str
    cause: str


class InfoQuery(msgspec.Struct, frozen=True, array_like=True, tag="info"):
    pass


class TransferRequest(msgspec.Struct, frozen=True, array_like=True, tag="xfer"):
    room: int
    dst_pages: list[int]  # where the prompt's pages from skip_pages on land, in order
    aux_slot: int
    skip_pages: int = 0  # leading prompt pages decode already holds (its prefix cache): not sent


class Abort(msgspec.Struct, frozen=True, array_like=True, tag="abort"):
    room: int
    reason: str


class Status(msgspec.Struct, frozen=True, array_like=True, tag="status"):
    room: int
    ok: bool
    reason: str = ""
    cause: str = ""
    reregister: bool = False  # prefill dropped this decode's registration


class Ping(msgspec.Struct, frozen=True, array_like=True, tag="ping"):
    seq: int
    rooms: list[int] = []  # rooms decode holds that have not sent their page ids yet (its prealloc queue)


class Pong(msgspec.Struct, frozen=True, array_like=True, tag="pong"):
    seq: int
    agent_name: str  # a restarted prefill answers with a new name
    rooms: list[int] = []  # the asking decode's rooms prefill's engine still looks after (RoomLife)


ControlMsg = Register | RegisterAck | RegisterRefused | InfoQuery | TransferRequest | Abort | Status | Ping | Pong

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ControlMsg)


def encode(msg: ControlMsg) -> bytes:
    return _ENCODER.encode(msg)


def decode(data: bytes) -> ControlMsg:
    return _DECODER.decode(data)
