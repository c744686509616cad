"""Issue 23, items 3-5, replayed against a real prefill KVManager process (NIXL, CURVE on):
a fake prefill learns nothing from decode, strangers reach nothing on the bootstrap port,
a spoofed Register drops no peer, and a registered peer's flood leaves prefill's memory
where it was. A real decode (in this process) keeps transferring byte-exact throughout."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator

import psutil
import pytest
import torch
import zmq
from nixl._api import nixl_agent, nixl_agent_config

from common.cluster_secret import ClusterSecret
from common.zmq_curve import RECV_HWM
from kv_transfer import AuxBuffer, AuxSlotAllocator, KVPoll
from kv_transfer.messages import (
    PROTOCOL_VERSION,
    Abort,
    InfoQuery,
    Register,
    RegisterAck,
    RegisterRefused,
    Status,
    TransferRequest,
    decode,
    encode,
)
from kv_transfer.side import layout_to_wire
from tests.kv_transfer.harness import Driver, PageAlloc, PoolSpec, Worker, make_manager, make_pool, page_bytes
from tests.security.byte_capture import ByteCapture

SECRET = secrets.token_hex(32).encode()
SPEC = PoolSpec()
RSS_SLACK = 20 << 20
FLOOD_REQUESTS, FLOOD_PAGES = 5000, 2000
FLOOD_ABORTS, ABORT_REASON = 3000, "x" * 100_000
# The registered flood's bound: by design prefill may hold RECV_HWM of the flood's messages queued
# at once (100 kB Aborts: 25.6 MB at the peak) and the heap keeps part of that peak after
# malloc_trim (fragmentation, more the deeper a loaded box lets the queue fill: 10-15 MiB quiet,
# 20.9 MiB once in CI under 20 MiB); plus RSS_SLACK. The regression it guards was +816 MiB.
FLOOD_RSS_BOUND = RECV_HWM * len(ABORT_REASON) + RSS_SLACK


class RealDecode:
    def __init__(self, **cfg: object) -> None:
        self.mgr, self.pool, self.aux = make_manager("decode", SPEC, None, **cfg)
        self.driver = Driver(self.mgr)
        self.pages = PageAlloc(SPEC.num_pages)
        self.slots = AuxSlotAllocator(SPEC.aux_slots)

    def transfer(self, prefill: Worker, n_pages: int = 3) -> None:
        """One room end to end; asserts Success and the bytes."""
        room, dst, slot = secrets.randbits(63), self.pages.take(n_pages), self.slots.alloc()
        assert slot is not None
        src = list(range(10, 10 + n_pages))
        self.driver.op_room(room, host="127.0.0.1", port=prefill.port, dst=dst, aux_slot=slot)
        prefill.call("room", room=room, chunks=[src], first_token=7)
        self.driver.run_until(lambda: self.driver.all_terminal([room]), 20, f"room {room}")
        assert self.driver.state(room) == KVPoll.Success, self.driver.op_states()
        ref = make_pool(SPEC, 1)
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(page_bytes(self.pool, 0, d), page_bytes(ref, 0, s))
        self.pages.put(dst)
        self.slots.free(slot)

    def close(self) -> None:
        self.mgr.check_integrity()
        self.mgr.shutdown()


@pytest.fixture(scope="module")
def prefill() -> Iterator[Worker]:
    worker = Worker("prefill", SPEC, seed=1, cluster_secret=SECRET, bootstrap_timeout_s=300.0)
    try:
        yield worker
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def real_decode() -> Iterator[RealDecode]:
    dec = RealDecode(cluster_secret=SECRET)
    try:
        yield dec
    finally:
        dec.close()


@pytest.fixture(scope="module")
def fake_agent() -> nixl_agent:
    """A real NIXL agent, as the attacker in the report had: prefill accepts its metadata."""
    return nixl_agent(f"attacker-{os.getpid()}-{secrets.token_hex(4)}",
                      nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def dealer(port: int, secret: bytes | None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # a DEALER whose only connection failed its handshake has no peer, and a send then blocks for
    # ever: every send is bounded (zmq.Again)
    sock.setsockopt(zmq.SNDTIMEO, 5000)
    if secret is not None:
        keys = ClusterSecret(secret).curve()
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = (
            keys.client_secret, keys.client_public, keys.server_public)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def register_msg(agent: nixl_agent, name: str, token: bytes, num_pages: int = SPEC.num_pages) -> Register:
    layout = layout_to_wire(make_pool(PoolSpec(num_pages=num_pages), None).layout)
    return Register(PROTOCOL_VERSION, name, agent.get_agent_metadata(), layout, [1 << 20], "DRAM", 0, 1 << 30,
                    AuxBuffer(1).row_bytes, SPEC.aux_slots, token)


def recv_one(sock: zmq.Socket, timeout_s: float) -> object | None:
    return decode(sock.recv()) if sock.poll(int(timeout_s * 1000)) else None


def test_decode_tells_an_unproven_prefill_nothing(real_decode: RealDecode) -> None:
    """Item 3: decode connects to whatever bootstrap_host a request names. Without the secret
    it sent that host Register (NIXL metadata, KV base addresses); now nothing leaves it."""
    listener = ByteCapture(accept_timeout_s=5.0, window_s=3.0)
    plain = zmq.Context.instance().socket(zmq.ROUTER)
    plain.setsockopt(zmq.LINGER, 0)
    plain_port = plain.bind_to_random_port("tcp://127.0.0.1")
    wrong = zmq.Context.instance().socket(zmq.ROUTER)
    wrong.setsockopt(zmq.LINGER, 0)
    wrong.curve_server = True
    wrong.curve_publickey, wrong.curve_secretkey = zmq.curve_keypair()
    wrong_port = wrong.bind_to_random_port("tcp://127.0.0.1")
    d = real_decode
    rooms = {}
    for port in (listener.port, plain_port, wrong_port):
        room, slot = secrets.randbits(63), d.slots.alloc()
        d.driver.op_room(room, host="127.0.0.1", port=port, dst=d.pages.take(2), aux_slot=slot)
        rooms[room] = port
    handshake = d.mgr.cfg.handshake_timeout_s
    d.driver.run_until(lambda: d.driver.all_terminal(list(rooms)), handshake + 10, "fake prefills refused")
    for room in rooms:
        assert d.driver.state(room) == KVPoll.Failed
        assert d.driver.plans[room].handle.failure_cause.value == "handshake"
    captured = listener.join(10)
    assert plain.poll(0) == 0 and wrong.poll(0) == 0, "a fake prefill received a message"
    assert d.mgr.agent_name.encode() not in captured and len(captured) < 1024, bytes(captured[:200])
    plain.close()
    wrong.close()
    listener.close()

    # The same fake against a decode without the secret: the leak the report showed.
    open_decode = RealDecode()
    sniff = zmq.Context.instance().socket(zmq.ROUTER)
    sniff.setsockopt(zmq.LINGER, 0)
    port = sniff.bind_to_random_port("tcp://127.0.0.1")
    try:
        open_decode.driver.op_room(1, host="127.0.0.1", port=port, dst=[1], aux_slot=0)
        assert sniff.poll(5000), "an unauthenticated decode sends Register at once"
        leaked = decode(sniff.recv_multipart()[-1])
        assert isinstance(leaked, Register) and leaked.agent_metadata and leaked.kv_bases
    finally:
        sniff.close()
        open_decode.mgr.shutdown()


def test_strangers_reach_nothing_on_the_bootstrap_port(prefill: Worker, real_decode: RealDecode,
                                                       fake_agent: nixl_agent) -> None:
    """Items 4-5 without the secret: nothing a stranger sends is ever delivered."""
    real_decode.transfer(prefill)
    rss = psutil.Process(prefill.proc.pid).memory_info().rss
    sock = dealer(prefill.port, None)
    with contextlib.suppress(zmq.Again):  # never connected: its queue fills and stays local, or it has no peer
        sock.send(encode(InfoQuery()))
        sock.send(encode(register_msg(fake_agent, real_decode.mgr.agent_name, b"guess")))
        for room in range(FLOOD_REQUESTS):
            sock.send(encode(TransferRequest(room, list(range(FLOOD_PAGES)), 0)), flags=zmq.NOBLOCK)
    assert recv_one(sock, 2.0) is None, "prefill answered a client without the secret"
    sock.close()
    real_decode.transfer(prefill)
    assert psutil.Process(prefill.proc.pid).memory_info().rss - rss < RSS_SLACK


def test_spoofed_register_drops_no_peer(prefill: Worker, real_decode: RealDecode, fake_agent: nixl_agent) -> None:
    """Item 4: Register under decode's agent name every 50 ms (here by a holder of the secret:
    a compromised cluster member) is refused; decode's registration and transfers stand."""
    failures = dict(real_decode.mgr.stats()["failures"])
    sock = dealer(prefill.port, SECRET)
    try:
        for _ in range(20):
            sock.send(encode(register_msg(fake_agent, real_decode.mgr.agent_name, secrets.token_bytes(16))))
            reply = recv_one(sock, 10.0)
            assert isinstance(reply, RegisterRefused) and "already registered" in reply.reason, reply
            real_decode.transfer(prefill)
            time.sleep(0.05)
    finally:
        sock.close()
    assert real_decode.mgr.stats()["failures"] == failures


def test_registered_flood_is_bounded(prefill: Worker, real_decode: RealDecode, fake_agent: nixl_agent) -> None:
    """Item 5: 5,000 TransferRequests x 2,000 page ids and 3,000 Aborts with 100 kB reasons from
    a registered peer grew prefill by 386 + 430 MiB; now every one is answered and refused or
    held within its bounds, and prefill's RSS stays within FLOOD_RSS_BOUND (~44 MiB)."""
    failures = dict(real_decode.mgr.stats()["failures"])
    sock = dealer(prefill.port, SECRET)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    try:
        real_decode.transfer(prefill)
        prefill.call("trim_heap")  # both samples count held pages, not the allocator's free ones
        rss = psutil.Process(prefill.proc.pid).memory_info().rss
        sock.send(encode(register_msg(fake_agent, fake_agent.name, b"t" * 16, num_pages=FLOOD_PAGES)))
        assert isinstance(recv_one(sock, 10.0), RegisterAck)
        pages = list(range(FLOOD_PAGES))
        for room in range(1, FLOOD_REQUESTS + 1):
            sock.send(encode(TransferRequest(room, pages, 0)))
        for room in range(10**9, 10**9 + FLOOD_ABORTS):
            sock.send(encode(Abort(room, ABORT_REASON)))
        replies: list[Status] = []
        deadline = time.monotonic() + 120
        while len(replies) < FLOOD_REQUESTS - 1 + FLOOD_ABORTS and time.monotonic() < deadline:
            msg = recv_one(sock, 1.0)
            if isinstance(msg, Status):
                replies.append(msg)
        refused = [r for r in replies if r.room <= FLOOD_REQUESTS]
        assert len(refused) == FLOOD_REQUESTS - 1, "one request fits the declared pages, every other is refused"
        assert all(not r.ok and "pages" in r.reason for r in refused)
        assert len(replies) - len(refused) == FLOOD_ABORTS
        raw = psutil.Process(prefill.proc.pid).memory_info().rss - rss
        prefill.call("trim_heap")
        grown = psutil.Process(prefill.proc.pid).memory_info().rss - rss
        print(f"prefill RSS after the registered flood: {raw / 2**20:+.1f} MiB, after trim {grown / 2**20:+.1f} MiB")
        assert grown < FLOOD_RSS_BOUND, f"prefill grew {grown / 2**20:.1f} MiB"
    finally:
        sock.close()
    real_decode.transfer(prefill)
    assert real_decode.mgr.stats()["failures"] == failures
