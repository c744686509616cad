"""Engine liveness pieces: the shared step clock, the fault spec, and the frontend's /health
and /health_generate on a real instance process (fake engine, which never writes the clock:
an idle engine)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.scheduler import step_fault
from common.scheduler.step_fault import StepFault
from common.server.liveness import StepClock, busy, hung_reason, stepping
from common.server.server_args import ServerArgs


def _hold_a_step(path: str, started: Any, release: Any) -> None:
    clock = StepClock.attach(path)
    clock.step_begin()
    started.set()
    release.wait(30)
    clock.step_end()
    clock.close()


def test_step_clock_is_read_across_processes_without_a_message(tmp_path: Path) -> None:
    path = str(tmp_path / "engine.clock")
    frontend = StepClock.create(path)
    assert frontend.read().steps == 0 and not frontend.read().in_step
    ctx = multiprocessing.get_context("spawn")
    started, release = ctx.Event(), ctx.Event()
    engine = ctx.Process(target=_hold_a_step, args=(path, started, release))
    engine.start()
    try:
        assert started.wait(30)
        snap = frontend.read()
        assert snap.steps == 1 and snap.in_step and snap.step_started_at <= time.monotonic()
        now = snap.step_started_at + 7.0
        assert hung_reason(snap, now, watchdog_timeout=10.0) is None
        reason = hung_reason(snap, now, watchdog_timeout=5.0)
        assert reason is not None and "step 1 has been running for 7.00s" in reason and "--watchdog-timeout 5s" in reason
    finally:
        release.set()
        engine.join(30)
    snap = frontend.read()
    assert snap.steps == 1 and not snap.in_step and snap.last_step_s >= 0.0
    assert hung_reason(snap, snap.step_started_at + 1e6, watchdog_timeout=1.0) is None  # idle is never hung
    frontend.remove()
    assert not Path(path).exists()


def test_stepping_marks_begin_and_end_even_when_the_step_raises(tmp_path: Path) -> None:
    clock = StepClock.create(str(tmp_path / "c"))
    with pytest.raises(RuntimeError), stepping(clock):
        assert clock.read().in_step
        raise RuntimeError("step failed")
    assert clock.read() == clock.read() and not clock.read().in_step and clock.read().steps == 1
    with stepping(None):  # no clock: nothing to do
        pass
    with busy(clock, "transfer poll"):
        snap = clock.read()
        assert snap.in_step and snap.phase == "transfer poll" and snap.steps == 1  # not a step
        reason = hung_reason(snap, snap.step_started_at + 9.0, watchdog_timeout=5.0)
        assert reason is not None and "hung in its transfer poll: running for 9.00s" in reason
    assert not clock.read().in_step and clock.read().steps == 1
    clock.remove()


def test_fault_spec_parses_and_counts_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    slow = StepFault.parse("slow_step_s=0.2,after_steps=2,steps=1")
    assert (slow.after_steps, slow.slow_step_s, slow.steps, slow.hang) == (2, 0.2, 1, False)
    slept: list[list[float]] = []
    monkeypatch.setattr(step_fault.time, "sleep", lambda s: slept[-1].append(s))
    for _ in range(4):
        slept.append([])
        slow.before_forward()
    assert slept == [[], [], [0.2], []]  # only the 3rd forward, by the configured 0.2 s
    hang = StepFault.parse("hang,after_steps=1")
    assert hang.hang and hang.after_steps == 1 and hang.steps is None
    assert StepFault.parse("hang,at=bootstrap").at == "bootstrap" and hang.at == "forward"
    for bad in ("", "slow_step_s=1,hang", "sleepy=1", "slow_step_s=x", "hang,steps=0", "hang,after_steps=-1",
                "hang,at=nowhere"):
        with pytest.raises(ValueError, match="engine fault spec"):
            StepFault.parse(bad)
    with pytest.raises(ValueError, match="--engine-fault-spec"):
        ServerArgs(engine_fault_spec="hang,slow_step_s=2")


def test_health_answers_from_the_clock_and_health_generate_generates(start_server: Any) -> None:
    server = start_server()
    health = httpx.get(server.url + "/health", timeout=5.0)
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "engine": {"steps": 0, "in_step": False, "step_age_s": 0.0,
                                                        "last_step_s": 0.0}}
    deep = httpx.get(server.url + "/health_generate", timeout=30.0)
    assert deep.status_code == 200 and deep.json() == {"status": "ok", "check": "generate"}
    stats = httpx.get(server.url + "/metrics", timeout=5.0).text
    assert "pdserve_requests_received 1.0" in stats  # the deep check reached the engine
