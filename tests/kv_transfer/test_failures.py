"""Failure rules between real processes: timeouts, dropped status, aborts at every state,
layout mismatch, duplicate rooms, injected NIXL errors. After each: Failed with a reason,
decode pages released only after prefill's drain ack (or the drain timeout), and a new
room between the survivors still works."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from kv_transfer import FailureCause, KVPoll, query_bootstrap
from tests.kv_transfer.harness import DecodeSide, PoolSpec, Worker, make_manager, make_pool, page_bytes

F, B, W, T, S = KVPoll.Failed, KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success
_REF = {}


def new_room() -> int:
    return random.getrandbits(63)


def ref_pool():  # what the module prefill worker (seed 1) holds
    if "pool" not in _REF:
        _REF["pool"] = make_pool(PoolSpec(), 1)
    return _REF["pool"]


def start(prefill: Worker, decode: DecodeSide, n: int = 3, *, hold_prefill: bool = False, hold_decode: bool = False,
          chunks: list[list[int]] | None = None) -> tuple[int, list[int]]:
    room = new_room()
    dst = decode.pages.take(n)
    slot = decode.slots.alloc()
    assert slot is not None
    decode.driver.op_room(room, host="127.0.0.1", port=prefill.port, dst=dst, aux_slot=slot, hold=hold_decode)
    decode.driver.step()  # init() right away (allowed while Bootstrapping)
    prefill.call("room", room=room, chunks=chunks or [[10 + i] for i in range(n)], first_token=5, hold=hold_prefill)
    return room, dst


def finish(decode: DecodeSide, room: int, dst: list[int]) -> None:
    """What a decode scheduler does when a request is over: wait until its pages may be freed."""
    decode.driver.run_until(lambda: decode.driver.plans[room].handle.pages_releasable(), 5, "pages releasable")
    decode.pages.put(dst)
    slot = decode.driver.plans[room].aux_slot
    decode.slots.free(slot)


def prefill_state(prefill: Worker, room: int, want: KVPoll, timeout: float = 5.0) -> tuple:
    return prefill.wait_states(lambda st: st[room][0] == want, timeout, f"prefill room {want.name}")[room]


def decode_wait(decode: DecodeSide, room: int, want: KVPoll, timeout: float = 5.0) -> None:
    decode.driver.run_until(lambda: decode.driver.state(room) == want, timeout, f"decode room {want.name}")


def assert_survivors_work(prefill: Worker, decode: DecodeSide) -> None:
    src = [40, 41, 99]
    room, dst = start(prefill, decode, 3, chunks=[src[:2], src[2:]])
    decode_wait(decode, room, S)
    for buf in range(4):
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(page_bytes(decode.pool, buf, d), page_bytes(ref_pool(), buf, s))
    prefill_state(prefill, room, S)
    finish(decode, room, dst)
    decode.slots.check_integrity()


@pytest.fixture(autouse=True)
def _survivors(prefill: Worker, decode: DecodeSide):
    yield
    prefill.call("faults", spec="")
    assert_survivors_work(prefill, decode)


def test_bootstrap_info(prefill: Worker, decode: DecodeSide) -> None:
    info = query_bootstrap("127.0.0.1", prefill.port)
    assert (info.layout.page_size, info.layout.num_layers, info.layout.dtype) == (4, 2, "bfloat16")
    assert info.port == prefill.port and info.agent_name.startswith("prefill-")
    with pytest.raises(TimeoutError):
        query_bootstrap("127.0.0.1", 1, timeout_s=0.2)


def test_bootstrap_timeout_on_prefill(prefill: Worker) -> None:
    room = new_room()
    prefill.call("room", room=room, chunks=[[1]])
    # failed by the 1 s bootstrap timer (the cause says so), waited for at most 5 s
    state, reason, cause, _ = prefill_state(prefill, room, F, timeout=5)
    assert cause == FailureCause.BOOTSTRAP_TIMEOUT.value and "bootstrap timeout" in reason


def test_dropped_status_is_a_transfer_timeout(prefill: Worker, decode: DecodeSide) -> None:
    prefill.call("faults", spec="drop_status_nth=1")
    room, dst = start(prefill, decode)
    prefill_state(prefill, room, S)  # prefill's writes completed; only the message was lost
    decode_wait(decode, room, F, timeout=5)
    h = decode.driver.plans[room].handle
    assert h.failure_cause == FailureCause.TRANSFER_TIMEOUT and "no status" in h.failure_reason
    finish(decode, room, dst)


def test_injected_post_failure(prefill: Worker, decode: DecodeSide) -> None:
    prefill.call("faults", spec="fail_post_nth=1")
    room, dst = start(prefill, decode)
    _, reason, cause, _ = prefill_state(prefill, room, F)
    assert cause == FailureCause.TRANSFER_ERROR.value and "injected" in reason
    decode_wait(decode, room, F)
    assert "injected" in decode.driver.plans[room].handle.failure_reason
    assert decode.driver.plans[room].handle.pages_releasable()
    finish(decode, room, dst)


def test_held_link_keeps_the_room_transferring_until_released(prefill: Worker, decode: DecodeSide,
                                                              tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    hold.touch()
    prefill.call("faults", spec=f"hold_file={hold}")
    room, dst = start(prefill, decode)
    for _ in range(2):  # the writes landed long ago; the held link keeps them unconfirmed
        prefill_state(prefill, room, T)
        decode_wait(decode, room, T)
        time.sleep(0.2)
    assert prefill.states()[room][0] == T
    hold.unlink()
    decode_wait(decode, room, S)
    prefill_state(prefill, room, S)
    finish(decode, room, dst)


def test_layout_mismatch_refused(prefill: Worker) -> None:
    mgr, _, _ = make_manager("decode", PoolSpec(head_dim=16), None)
    try:
        r = mgr.create_receiver("rid", new_room(), "127.0.0.1", prefill.port)
        deadline = time.monotonic() + 5
        while r.poll() != F and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.failure_cause == FailureCause.LAYOUT_MISMATCH
        assert "head_dim 8 != 16" in r.failure_reason or "head_dim 16 != 8" in r.failure_reason
    finally:
        mgr.shutdown()


def test_duplicate_room_on_prefill(prefill: Worker, decode: DecodeSide) -> None:
    room, dst = start(prefill, decode, hold_decode=True)
    prefill.call("room", room=room, chunks=[[1], [2], [3]], key="dup")
    dup = prefill.wait_states(lambda st: st["dup"][0] == F, 5)["dup"]
    assert dup[2] == FailureCause.DUPLICATE_ROOM.value and "already has a live sender" in dup[1]
    decode.driver.op_release(room)
    decode_wait(decode, room, S)
    finish(decode, room, dst)


def test_duplicate_room_on_decode_and_across_decodes(prefill: Worker, decode: DecodeSide) -> None:
    room, dst = start(prefill, decode, hold_prefill=True)
    decode.driver.op_room(room, host="127.0.0.1", port=prefill.port, key="dup")
    decode_wait(decode, "dup", F)  # type: ignore[arg-type]
    assert decode.driver.plans["dup"].handle.failure_cause == FailureCause.DUPLICATE_ROOM
    other, _, _ = make_manager("decode", PoolSpec(), None)
    try:
        r = other.create_receiver("rid", room, "127.0.0.1", prefill.port)
        r.init([1, 2, 3], 0)
        deadline = time.monotonic() + 5
        while r.poll() != F and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.failure_cause == FailureCause.DUPLICATE_ROOM and r.pages_releasable()
    finally:
        other.shutdown()
    prefill.call("release", room=room)
    decode_wait(decode, room, S)
    finish(decode, room, dst)


def test_decode_abort_while_bootstrapping(decode: DecodeSide) -> None:
    r = decode.mgr.create_receiver("rid", new_room(), "127.0.0.1", 1)  # nobody listens there
    assert r.poll() == B
    r.abort("client gone")
    assert r.poll() == F and r.failure_reason == "client gone" and r.pages_releasable()


def test_decode_abort_while_waiting_for_input(prefill: Worker, decode: DecodeSide) -> None:
    room, dst = start(prefill, decode, hold_decode=True)
    decode_wait(decode, room, W)
    decode.driver.op_abort(room, "client gone")
    assert decode.driver.plans[room].handle.pages_releasable()  # no page ids were ever sent
    _, reason, cause, _ = prefill_state(prefill, room, F)
    assert cause == FailureCause.ABORTED.value and "aborted by decode" in reason
    decode.pages.put(dst)
    decode.slots.free(decode.driver.plans[room].aux_slot)


def test_decode_abort_during_the_handshake_reaches_prefill(prefill: Worker, tmp_path: Path) -> None:
    """A decode that gives up before its first handshake with a prefill finished still tells
    that prefill, which would otherwise hold the request until its bootstrap timeout."""
    mgr, _, _ = make_manager("decode", PoolSpec(), None)
    stall = tmp_path / "stall"
    stall.touch()
    try:
        room = new_room()
        prefill.call("faults", spec=f"stall_file={stall}")  # the handshake waits for prefill's thread
        prefill.call("room", room=room, chunks=[[1]], first_token=5)
        r = mgr.create_receiver("rid", room, "127.0.0.1", prefill.port)
        r.init([1, 2], 0)
        time.sleep(0.2)
        assert not r.request_sent  # still handshaking (prefill's thread is stalled): page ids not sent
        r.abort("client gone")
        assert r.poll() == F
        stall.unlink()
        deadline = time.monotonic() + 2
        while not r.pages_releasable() and time.monotonic() < deadline:  # no page ids were ever sent
            time.sleep(0.01)
        assert r.pages_releasable()
        _, reason, cause, _ = prefill_state(prefill, room, F)
        assert cause == FailureCause.ABORTED.value and "aborted by decode" in reason
    finally:
        stall.unlink(missing_ok=True)
        mgr.shutdown()


@pytest.mark.parametrize("mid_transfer", [False, True])
def test_decode_abort_while_transferring(prefill: Worker, decode: DecodeSide, mid_transfer: bool) -> None:
    if mid_transfer:
        prefill.call("faults", spec="delay_ms=150")
    room, dst = start(prefill, decode, 8, hold_prefill=not mid_transfer)
    decode_wait(decode, room, T)
    prefill_state(prefill, room, T if mid_transfer else W)
    decode.driver.op_abort(room, "client gone")
    h = decode.driver.plans[room].handle
    assert h.poll() == F
    if mid_transfer:  # a write is in flight (posts take 150 ms each): the pages stay held
        assert not h.pages_releasable(), "pages must stay held until prefill drained"
    finish(decode, room, dst)
    assert h.drain_deadline is not None and time.monotonic() < h.drain_deadline, (
        "released by prefill's ack, not by the drain timeout")
    _, reason, cause, _ = prefill_state(prefill, room, F)
    assert cause == FailureCause.ABORTED.value


@pytest.mark.parametrize("at", ["bootstrapping", "waiting", "transferring"])
def test_prefill_abort(prefill: Worker, decode: DecodeSide, at: str) -> None:
    if at == "transferring":
        prefill.call("faults", spec="delay_ms=150")
    room, dst = start(prefill, decode, 4, hold_decode=at == "bootstrapping", hold_prefill=at == "waiting")
    if at == "bootstrapping":
        assert prefill.states()[room][0] == B
    else:
        prefill_state(prefill, room, W if at == "waiting" else T)
    prefill.call("abort", room=room, reason="prefill OOM")
    prefill_state(prefill, room, F)
    decode.driver.op_release(room)
    decode_wait(decode, room, F)
    h = decode.driver.plans[room].handle
    assert h.failure_cause == FailureCause.ABORTED and "prefill OOM" in h.failure_reason
    finish(decode, room, dst)


def test_idle_manager_threads_use_no_cpu(decode: DecodeSide) -> None:
    tid = decode.mgr._thread.native_id

    def cpu() -> float:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / 100.0  # utime + stime, clock ticks

    c0, t0 = cpu(), time.monotonic()
    time.sleep(1.0)
    share = (cpu() - c0) / (time.monotonic() - t0)
    assert share < 0.05, f"idle decode manager thread used {share:.0%} CPU"


def test_a_queued_room_outlives_the_transfer_timeout(prefill: Worker, decode: DecodeSide) -> None:
    """Prefill's engine holds the room (queued: it polls it, sends nothing) past decode's 3 s
    transfer timeout: prefill's pongs name the room, so decode keeps waiting, then succeeds."""
    room, dst = start(prefill, decode, hold_prefill=True)
    decode_wait(decode, room, T)
    until = time.monotonic() + 3.0 * 1.5
    while time.monotonic() < until:
        decode.driver.step()
        assert decode.driver.state(room) == T, decode.driver.plans[room].handle.failure_reason
        time.sleep(0.05)
    prefill.call("release", room=room)
    decode_wait(decode, room, S)
    prefill_state(prefill, room, S)
    finish(decode, room, dst)


def test_a_stalled_link_still_times_out(prefill: Worker, decode: DecodeSide, tmp_path: Path) -> None:
    """The engine stays alive but no WRITE completes: after prefill's heartbeat timeout (1 s)
    the room is no longer named, and decode fails it within its transfer timeout after that."""
    hold = tmp_path / "hold"
    hold.touch()
    prefill.call("faults", spec=f"hold_file={hold}")
    room, dst = start(prefill, decode)
    decode_wait(decode, room, T)
    t0 = time.monotonic()
    decode_wait(decode, room, F, timeout=10.0)
    took = time.monotonic() - t0
    h = decode.driver.plans[room].handle
    assert h.failure_cause == FailureCause.TRANSFER_TIMEOUT and "sign of life" in (h.failure_reason or "")
    assert 3.0 <= took <= 3.0 + 1.0 + 0.2 + 3.0, f"failed after {took:.1f}s"
    hold.unlink()
    finish(decode, room, dst)
