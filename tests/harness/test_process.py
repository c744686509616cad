"""The process harness itself: ports never handed out twice (also across test processes), a
child's whole group stopped, failures that carry the log, and the session's last-resort reaper."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness.process import ChildProcess, _leftovers, free_port, pid_alive, wait_until

# A parent that starts a grandchild in its own group and then waits for SIGTERM.
PARENT = textwrap.dedent("""
    import signal, subprocess, sys, time
    kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print("kid", kid.pid, flush=True)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # exits, leaving the kid behind
    time.sleep(120)
""")


def _kid_pid(child: ChildProcess) -> int:
    child.wait_for(lambda: "kid " in child.log(), 30.0, "the grandchild's pid")
    return int(child.log().split("kid ", 1)[1].split()[0])


def test_free_ports_are_distinct_and_held_across_processes() -> None:
    ports = {free_port() for _ in range(20)}
    assert len(ports) == 20
    # another test process sees every one of them as taken (the flock is held by this one)
    code = textwrap.dedent(f"""
        from tests.harness.process import _claim
        print(sum(_claim(p) for p in {sorted(ports)!r}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_stop_terminates_the_leader_and_kills_its_group() -> None:
    child = ChildProcess([sys.executable, "-c", PARENT], "parent")
    try:
        kid = _kid_pid(child)
        assert child.stop() == 0  # the leader exited on SIGTERM by itself
        assert wait_until(lambda: not pid_alive(kid), 10.0), "the group's leftover survived stop()"
    finally:
        child.close()


def test_stop_without_leftovers_leaves_them_to_reap() -> None:
    child = ChildProcess([sys.executable, "-c", PARENT], "parent")
    try:
        kid = _kid_pid(child)
        assert child.stop(leftovers=False) == 0
        assert pid_alive(kid) and _leftovers(child.pid) == [kid]
        child.reap()  # what reap_all() does for each child at the session's end
        assert wait_until(lambda: not pid_alive(kid), 10.0), "reap left a process running"
    finally:
        child.close()


def test_a_stopped_group_is_continued_and_terminated_then_restarts() -> None:
    child = ChildProcess([sys.executable, "-c", "import time; time.sleep(120)"], "sleeper")
    try:
        child.signal_group(signal.SIGSTOP)
        assert child.alive
        assert child.stop(timeout_s=30.0) == -signal.SIGTERM  # continued first, then terminated
        child.start()  # same log, a header per start
        assert child.alive
        child.kill9()
        assert not child.alive and "==== start #1 ====" in child.log()
    finally:
        child.close()


def test_waits_fail_fast_with_the_log_tail() -> None:
    child = ChildProcess([sys.executable, "-c", "print('boom', flush=True); raise SystemExit(3)"], "crasher")
    try:
        with pytest.raises(RuntimeError, match=r"(?s)crasher exited with 3 .*boom"):
            child.wait_http(f"http://127.0.0.1:{free_port()}/health", 60.0)
    finally:
        child.close()
    quiet = ChildProcess([sys.executable, "-c", "print('quiet', flush=True); import time; time.sleep(120)"], "quiet")
    try:
        quiet.wait_for(lambda: "quiet" in quiet.log(), 30.0, "its first line")
        with pytest.raises(TimeoutError, match=r"(?s)no never within 0.3s.*quiet"):
            quiet.wait_for(lambda: False, 0.3, "never")
    finally:
        quiet.close()
