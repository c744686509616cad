"""A role restarted at the same host and port is a new NIXL agent (issue 41, item 2).

One prefill and one decode of their own. Each case kills one role with -9 while requests are
in flight and restarts it at once on the same ports; then new requests go through, and:
- every in-flight request ends (tokens exact or an error) within a bound, none hangs;
- every new request succeeds with transformers' greedy tokens;
- every pool is whole at idle and the surviving role never crashed.

Prefill restart: decode pings every 60 s here, so nothing but the new requests' own traffic
tells it that its prefill is a new process. Its first request reaches the new prefill on the
reconnected socket, which asks decode to register anew: the request must be sent again after
the new handshake (it used to fail), and what was sent to the dead agent must fail then (it
used to wait for the 300 s transfer timeout).
Decode restart: the prefill keeps the dead decode's agent until a WRITE towards it fails or its
heartbeat lapses; the new decode registers as a new peer and is served at once.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.client import Batch, Job, run_jobs
from tests.reliability.procs import Instance, spawn_all, wait_whole
from tests.reliability.scenario import assert_correct, hold, prompts

POOL = ["--max-total-tokens", "4096", "--page-size", "16"]
QUIET_DECODE = ["--disaggregation-heartbeat-interval", "60", "--disaggregation-heartbeat-timeout", "180",
                "--disaggregation-drain-timeout", "3"]
HOLD_FILE = Path(tempfile.gettempdir()) / f"pdserve-restart-hold-{os.getpid()}"  # while it exists no KV WRITE completes
PREFILL = ["--disaggregation-heartbeat-timeout", "6", "--disaggregation-fault-spec", f"hold_file={HOLD_FILE}"]
END_BOUND_S = 20.0  # after the new requests completed, every in-flight one has ended


@pytest.fixture(scope="module")
def pair(tiny_llama_path: str) -> Iterator[tuple[Instance, Instance]]:
    model = Path(tiny_llama_path)
    p = Instance("restart_p", "prefill", model, [*POOL, *PREFILL])
    d = Instance("restart_d", "decode", model, [*POOL, *QUIET_DECODE])
    spawn_all([p, d])
    try:
        yield p, d
    finally:
        p.stop()
        d.stop()


def _restart_under_load(victim: Instance, survivor: Instance, p: Instance, d: Instance, model: str,
                        seed: int) -> None:
    assert_correct(model, run_jobs([Job(p, d, pr, 4) for pr in prompts(2, 16, seed)]))  # registered
    HOLD_FILE.touch()
    try:  # the requests sit in prefill's inflight queue, decode has sent their page ids
        in_flight = Batch([Job(p, d, pr, 4) for pr in prompts(4, 96, seed + 1)], timeout_s=120.0)
        hold(p, lambda s: s["num_inflight_queue_reqs"] >= 4, "4 transfers in flight")
        victim.kill9()
    finally:
        HOLD_FILE.unlink(missing_ok=True)
    victim.restart()
    victim.wait_healthy()
    fresh = run_jobs([Job(p, d, pr, 6) for pr in prompts(4, 24, seed + 2)], timeout_s=60.0)
    fresh_done = time.monotonic()
    assert all(o.ok for o in fresh), [(o.prefill.error, o.decode.error) for o in fresh if not o.ok]
    assert_correct(model, fresh)
    hit = in_flight.wait()
    for o in hit:
        assert o.ok or o.failed, o
        assert o.decode.done_at is not None and o.decode.done_at <= fresh_done + END_BOUND_S, o
    assert_correct(model, [o for o in hit if o.ok])
    assert survivor.alive and victim.restarts >= 1
    wait_whole([p, d], timeout_s=30.0)


def test_prefill_restarted_on_its_port_is_registered_anew(pair: tuple[Instance, Instance],
                                                           tiny_llama_path: str) -> None:
    p, d = pair
    _restart_under_load(p, d, p, d, tiny_llama_path, seed=100)


def test_decode_restarted_on_its_port_is_a_new_peer(pair: tuple[Instance, Instance],
                                                     tiny_llama_path: str) -> None:
    p, d = pair
    _restart_under_load(d, p, p, d, tiny_llama_path, seed=200)
