"""kill -9 of either process mid-transfer: the survivor fails the affected rooms with a
reason within the heartbeat bound, never blocks, holds decode pages until the drain
timeout, and serves a new peer afterwards."""

from __future__ import annotations

import random
import time

from kv_transfer import FailureCause, KVPoll
from tests.harness.process import LOAD_SLACK_S
from tests.kv_transfer.harness import FAST, DecodeSide, Driver, PoolSpec, Worker, make_manager

F, T, S = KVPoll.Failed, KVPoll.Transferring, KVPoll.Success
HEARTBEAT_BOUND_S = FAST["heartbeat_timeout_s"] + FAST["heartbeat_interval_s"] + LOAD_SLACK_S


def _decode_room(decode: DecodeSide, port: int, n: int) -> tuple[int, list[int]]:
    room, dst = random.getrandbits(63), decode.pages.take(n)
    slot = decode.slots.alloc()
    assert slot is not None
    decode.driver.op_room(room, host="127.0.0.1", port=port, dst=dst, aux_slot=slot)
    decode.driver.step()
    return room, dst


def test_kill_prefill_mid_transfer(decode: DecodeSide) -> None:
    victim = Worker("prefill", PoolSpec(), seed=1)
    try:
        victim.call("faults", spec="delay_ms=200")
        rooms = [_decode_room(decode, victim.port, 6) for _ in range(3)]
        for room, _ in rooms:
            victim.call("room", room=room, chunks=[[i] for i in range(1, 7)])
        victim.wait_states(lambda st: any(s[0] == T for s in st.values()), 5, "a room transferring")
        victim.kill()
        t0 = time.monotonic()
        ids = [r for r, _ in rooms]
        decode.driver.run_until(lambda: decode.driver.all_terminal(ids), 5, "rooms failed")  # type: ignore[arg-type]
        assert time.monotonic() - t0 < HEARTBEAT_BOUND_S, "heartbeat bound (timeout + interval + slack)"
        for room, _ in rooms:
            h = decode.driver.plans[room].handle
            assert h.poll() == F and h.failure_cause == FailureCause.PEER_LOST and "no heartbeat" in h.failure_reason
            assert not h.pages_releasable(), "a dead prefill sends no drain ack: hold until the timeout"
        decode.driver.run_until(
            lambda: all(decode.driver.plans[r].handle.pages_releasable() for r in ids), 5, "drain timeout"
        )
        assert time.monotonic() - t0 > 2.9, "released by the 3 s drain timeout"
        for room, dst in rooms:
            decode.pages.put(dst)
            decode.slots.free(decode.driver.plans[room].aux_slot)
    finally:
        victim.kill()
    fresh = Worker("prefill", PoolSpec(), seed=1)  # a new prefill works with the same decode manager
    try:
        room, dst = _decode_room(decode, fresh.port, 2)
        fresh.call("room", room=room, chunks=[[3, 4]])
        decode.driver.run_until(lambda: decode.driver.state(room) == S, 5, "room after restart")
        decode.pages.put(dst)
        decode.slots.free(decode.driver.plans[room].aux_slot)
    finally:
        fresh.stop()
    decode.mgr.check_integrity()


def test_kill_decode_mid_transfer() -> None:
    mgr, _, _ = make_manager("prefill", PoolSpec(), seed=1)
    prefill = Driver(mgr)
    victim = Worker("decode", PoolSpec(), None)
    try:
        mgr.set_faults("delay_ms=100")
        rooms = [random.getrandbits(63) for _ in range(3)]
        for i, room in enumerate(rooms):
            victim.call("room", room=room, host="127.0.0.1", port=mgr.bootstrap_port, dst=list(range(10 * i + 1, 10 * i + 7)), aux_slot=i)
            prefill.op_room(room, chunks=[[p] for p in range(1, 7)])
        prefill.run_until(
            lambda: all(prefill.state(r) >= KVPoll.WaitingForInput for r in rooms) and any(prefill.state(r) == T for r in rooms),
            5,
            "all rooms bootstrapped, one transferring",
        )
        victim.kill()
        t0 = time.monotonic()
        prefill.run_until(lambda: prefill.all_terminal(rooms), 5, "prefill rooms failed")  # type: ignore[arg-type]
        assert time.monotonic() - t0 < HEARTBEAT_BOUND_S
        for room in rooms:
            h = prefill.plans[room].handle
            assert h.poll() == F and h.failure_cause in (FailureCause.PEER_LOST, FailureCause.TRANSFER_ERROR), h
            assert h.failure_reason
        mgr.set_faults("")
        mgr.check_integrity()
    finally:
        victim.kill()
    fresh = Worker("decode", PoolSpec(), None)
    try:
        room = random.getrandbits(63)
        fresh.call("room", room=room, host="127.0.0.1", port=mgr.bootstrap_port, dst=[5, 9], aux_slot=0)
        prefill.op_room(room, chunks=[[1], [2]])
        prefill.run_until(lambda: prefill.state(room) == S, 5, "room with a new decode")
        fresh.wait_states(lambda st: st[room][0] == S, 5, "decode Success")
    finally:
        fresh.stop()
        mgr.shutdown()
    assert not mgr._thread.is_alive()
