"""The stub pool hands each test its stubs as started: behavior and stats restored, killed ones replaced."""

from __future__ import annotations

import httpx

from tests.router.router_procs import StubPool


def test_pooled_stubs_come_back_as_started_and_dead_ones_are_replaced() -> None:
    pool = StubPool()
    try:
        a, b = pool.take("decode"), pool.take("decode")
        for w in (a, b):
            w.wait_up()
        a.control(health_status=503, fail_status=500)
        assert httpx.get(a.url + "/health", timeout=5).status_code == 503
        b.kill()
        pool.put(a)
        pool.put(b)
        assert pool.idle == {"decode": [a]} and not b.alive
        again = pool.take("decode")
        assert again is a and pool.started == 2
        assert httpx.get(a.url + "/health", timeout=5).status_code == 200
        assert again.stats()["health"] == 1 and again.stats()["generate"] == 0
        fresh = pool.take("decode")
        assert fresh is not a and pool.started == 3
        fresh.wait_up()
        pool.put(fresh)
        pool.put(again)
    finally:
        pool.stop()
    assert not a.alive
