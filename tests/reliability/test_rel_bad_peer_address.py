"""One bad request must not take the KV transfer layer down with it.

The frontend now refuses a malformed bootstrap_host (400), but the transfer layer itself
must survive whatever address reaches it: a receiver whose peer address cannot even be
connected to must fail alone, the manager must keep serving other receivers, and its
shutdown stays bounded. Runs in a child process: today the manager thread dies and
shutdown() then blocks forever in zmq's context termination.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.reliability.procs import REPO_ROOT

SCENARIO = textwrap.dedent("""
    import threading
    from kv_transfer import FailureCause, KVPoll
    from tests.kv_transfer.harness import PoolSpec, make_manager, wait_for

    mgr, _, _ = make_manager("decode", PoolSpec(), seed=0)
    bad = mgr.create_receiver("bad", 1, "not a host", 1)
    other = None
    try:
        wait_for(lambda: bad.poll() == KVPoll.Failed, 3.0, "the bad receiver to fail")
        other = mgr.create_receiver("other", 2, "127.0.0.1", 1)  # well-formed, nobody listening
        wait_for(lambda: other.poll() == KVPoll.Failed, 5.0, "the handshake timeout")
        assert other.failure_cause == FailureCause.HANDSHAKE, other.failure_reason
    finally:
        print("states:", bad, other, flush=True)
        t = threading.Thread(target=mgr.shutdown, daemon=True)
        t.start()
        t.join(10.0)
        assert not t.is_alive(), "KVManager.shutdown() did not return within 10 s"
    print("SURVIVED", flush=True)
""")


def test_bad_peer_address_fails_only_its_receiver() -> None:
    try:
        out = subprocess.run([sys.executable, "-c", SCENARIO], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=40)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"scenario hung: {e.stdout!r} {e.stderr!r}") from None
    assert out.returncode == 0 and "SURVIVED" in out.stdout, out.stdout + out.stderr[-3000:]
