"""A decode request that outgrows the whole KV pool: the scheduler keeps at least one
request and, when even that one cannot take another token, finishes it with an "out of
KV memory" error. The client must get that error and the decode instance must live on."""

from __future__ import annotations

from tests.reliability.client import Job, run_jobs
from tests.reliability.cluster import Cluster
from tests.reliability.scenario import prompts


def test_request_larger_than_the_decode_pool_fails_alone(whole_cluster: Cluster) -> None:
    c = whole_cluster
    # d_small holds 640 tokens; admission reserves only ~0.2 x max_new, so 300 + 700 gets in
    (o,) = run_jobs([Job(c.p_fast, c.d_small, prompts(1, 300, seed=101)[0], 700)])
    assert o.decode.error is not None and "memory" in o.decode.error, o.decode
    assert c.d_small.alive and c.d_small.healthy(), c.d_small.log()
    (after,) = run_jobs([Job(c.p_fast, c.d_small, prompts(1, 20, seed=102)[0], 8)])
    assert after.ok, after
    c.wait_whole()
