"""SIGSTOP a prefill instance (frontend and engine) while its requests transfer KV.

Shorter than the heartbeat timeout: nothing is aborted and every request completes
exactly. Longer: decode fails those requests within the heartbeat bound, while the
prefill is still stopped (an error, not a hang); after SIGCONT the prefill answers its
own clients, the router marks it up again, and it serves new requests.
"""

from __future__ import annotations

import time

import pytest

from tests.reliability.client import Batch, Job, run_jobs
from tests.reliability.cluster import HB_INTERVAL_S, HB_TIMEOUT_S, HEARTBEAT_BOUND_S, Cluster
from tests.reliability.scenario import assert_correct, assert_failed_within, hold, prompts, router_recovers

# beyond first: the scenarios after it overlap its drain wait
STOPS = {"beyond_heartbeat": HB_TIMEOUT_S + 3.0, "below_heartbeat": HB_TIMEOUT_S - 2 * HB_INTERVAL_S}


@pytest.mark.parametrize("stop", list(STOPS))
def test_sigstop_prefill(whole_cluster: Cluster, tiny_llama_path: str, stop: str) -> None:
    c = whole_cluster
    victim, decode = c.p_slow, c.d_big
    failures_before = decode.stats()["num_transfer_failures_total"]
    jobs = [Job(victim, decode, p, 4, cancel_prefill=False) for p in prompts(6, 160, seed=61)]
    batch = Batch(jobs)
    hold(victim, lambda s: s["num_inflight_queue_reqs"] >= 2, "requests transferring")
    t_stop = time.monotonic()
    victim.sigstop()
    try:
        time.sleep(STOPS[stop])
        if stop == "beyond_heartbeat":
            c.router.wait_worker(victim, healthy=False, timeout_s=1.0)
    finally:
        t_cont = time.monotonic()
        victim.sigcont()
    outcomes = batch.wait()
    if stop == "below_heartbeat":
        assert_correct(tiny_llama_path, outcomes, sample=2)
        assert decode.stats()["num_transfer_failures_total"] == failures_before, "a short stop aborted a transfer"
        c.wait_whole_but_drains()  # the scenario before may have left a drain pending
        return
    # decode gave up on the stopped prefill while it was still stopped
    assert_failed_within(outcomes, t_stop, HEARTBEAT_BOUND_S, side="decode")
    assert all(o.decode.done_at is not None and o.decode.done_at < t_cont for o in outcomes)
    # the prefill's own clients get its verdict soon after it resumes (an error, or success
    # when it finished writing into pages decode still holds: the router only reads errors)
    for o in outcomes:
        assert o.prefill.status != 0 and o.prefill.done_at is not None, o.prefill
        assert o.prefill.done_at - t_cont <= HEARTBEAT_BOUND_S, o.prefill
    router_recovers(c, victim, tiny_llama_path)
    assert_correct(tiny_llama_path, run_jobs([Job(victim, decode, p, 8) for p in prompts(2, 30, seed=62)]))
    # decode holds the pages a stopped prefill may still write until the drain timeout
    c.wait_whole_but_drains(drain_from=t_stop)
