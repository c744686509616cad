"""The manager thread's health: a stuck thread is reported and recovers; a dead thread is
reported, fails every live handle and every new one, and decode pages still come back
(the drain deadline is checked by the handle itself, not only by the dead thread)."""

from __future__ import annotations

import random
import time

from kv_transfer import AuxSlotAllocator, KVPoll
from tests.kv_transfer.harness import PoolSpec, Worker, make_manager, wait_for


def test_stuck_thread_is_reported_then_recovers() -> None:
    mgr, _, _ = make_manager("decode", PoolSpec(), None, stall_report_s=0.3)
    try:
        assert mgr.health() is None
        mgr.set_faults("stall_s=1.2")
        wait_for(lambda: mgr.health() is not None, 1.0, "stall reported")
        assert "has not completed an iteration" in (mgr.health() or "")
        wait_for(lambda: mgr.health() is None, 3.0, "recovered after the stall")
        assert mgr.stats()["injected_faults"] == {"stall": 1}
    finally:
        mgr.shutdown()


def test_dead_thread_fails_everything_and_releases_pages(prefill: Worker) -> None:
    spec = PoolSpec()
    mgr, _, _ = make_manager("decode", spec, None, drain_timeout_s=0.5)
    slots = AuxSlotAllocator(spec.aux_slots)
    try:
        room = random.getrandbits(63)
        prefill.call("room", room=room, chunks=[[10], [11]], first_token=5, hold=True)  # never sends
        recv = mgr.create_receiver(f"rid-{room}", room, "127.0.0.1", prefill.port)
        slot = slots.alloc()
        assert slot is not None
        recv.init([3, 4], slot)
        wait_for(lambda: recv.request_sent, 5.0, "decode sent its page ids")
        assert not recv.pages_releasable()

        mgr.set_faults("crash_after_s=0.01")
        wait_for(lambda: recv.poll() == KVPoll.Failed, 5.0, "live receiver failed by the crash")
        assert "not running" in (mgr.health() or "")
        assert recv.failure_reason and "shut down" in recv.failure_reason
        # Prefill may still be writing: the pages stay held until the drain deadline, which
        # passes although no thread is left to watch it.
        assert not recv.pages_releasable()
        wait_for(recv.pages_releasable, 2.0, "pages released at the drain deadline")

        late = mgr.create_receiver("rid-late", room + 1, "127.0.0.1", prefill.port)
        assert late.poll() == KVPoll.Failed and "not running" in (late.failure_reason or "")
        late.init([5], slot)
        assert late.pages_releasable()
    finally:
        t0 = time.monotonic()
        mgr.shutdown()
        assert time.monotonic() - t0 < mgr.cfg.shutdown_timeout_s, "shutdown waited for the dead thread's join timeout"
        prefill.call("abort", room=room)
