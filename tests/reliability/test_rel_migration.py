"""kill -9 the decode under 8 running streams behind a 1P2D router (issue 19).

With --max-migrations 1 every stream goes on from the other decode and ends exactly as an
undisturbed run (same ids, finish_reason length, one [DONE]): four are greedy, four sample
with a seed (the migrated request's seed continues the sampler's noise position); with --max-migrations 0 every
stream ends with an in-band error, as before migration existed. Every pool is whole at the end.

The 8 prompts share a 24-token prefix and the decode policy is cache_aware, so the router puts
all 8 on one decode; the victim is the decode the router reports them on.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.harness.process import stop_all, wait_until
from tests.reliability.client import RouterBatch, RouterOutcome
from tests.reliability.cluster import DECODE, HEARTBEAT_BOUND_S, Cluster, Router
from tests.reliability.procs import Instance, spawn_all, wait_whole
from tests.reliability.scenario import prompts

N, MAX_NEW = 8, 300
SAMPLING: list[dict[str, Any] | None] = [None] * 4 + [{"temperature": 1.0, "seed": 1000 + i} for i in range(4)]


@dataclass
class PD:
    p: Instance
    decodes: list[Instance]
    r1: Router  # --max-migrations 1
    r0: Router  # --max-migrations 0

    @property
    def instances(self) -> list[Instance]:
        return [self.p, *self.decodes]


@pytest.fixture(scope="module")
def pd(cluster: Cluster) -> Iterator[PD]:
    """Two decodes of its own behind the shared cluster's p_fast (never killed here)."""
    cluster.revive()
    p = cluster.p_fast
    decodes = [Instance(f"d{i}", "decode", cluster.model_dir, ["--max-total-tokens", "16384", *DECODE])
               for i in (1, 2)]
    spawn_all(decodes)
    routers: list[Router] = []
    try:
        for n in ("1", "0"):
            routers.append(Router(cluster.model_dir, [p], decodes, "--policy", "cache_aware", "--max-migrations", n))
        for r in routers:
            r.wait_ready()
        yield PD(p, decodes, routers[0], routers[1])
    finally:
        stop_all([*(r.proc.child for r in routers), *(inst.child for inst in decodes)])


def _prompts() -> list[list[int]]:
    shared = prompts(1, 24, seed=41)[0]
    return [shared + tail for tail in prompts(N, 8, seed=42)]


def _run_and_kill(pd: PD, router: Router) -> tuple[list[RouterOutcome], float]:
    """8 streams through `router`; kill -9 the decode they run on once each has streamed tokens."""
    batch = RouterBatch(router.url, [(pr, MAX_NEW) for pr in _prompts()], sampling=SAMPLING)
    on: list[Instance] = []

    def placed() -> bool:
        w = router.workers()
        on[:] = [d for d in pd.decodes if w[d.url]["in_flight_requests"] == N]
        return bool(on)

    assert wait_until(placed, 30.0, period_s=0.05), f"the 8 streams are not on one decode: {router.workers()}"
    victim = on[0]
    # every client has tokens: the router streamed each one's first byte (else it would retry, not migrate)
    assert wait_until(lambda: all(o.output_ids for o in batch.live), 60.0, period_s=0.02), \
        f"not every stream started: {[len(o.output_ids) for o in batch.live]}"
    assert all(len(o.output_ids) < MAX_NEW for o in batch.live)
    t_kill = time.monotonic()
    victim.kill9()
    out = batch.wait()
    victim.restart()
    victim.wait_healthy()
    for r in (pd.r0, pd.r1):
        r.wait_worker(victim, healthy=True, timeout_s=20.0)
    return out, t_kill


def _whole(pd: PD) -> None:
    wait_whole(pd.instances, 40.0)
    for r in (pd.r0, pd.r1):
        assert wait_until(r.idle, 10.0), f"router load not released: {r.workers()}"


def test_kill_decode_migrates_every_stream(pd: PD) -> None:
    p_before = httpx.get(pd.p.url + "/get_load", timeout=10).json()  # the shared prefill has served others
    undisturbed = RouterBatch(pd.r1.url, [(pr, MAX_NEW) for pr in _prompts()], sampling=SAMPLING).wait()
    for o in undisturbed:
        assert o.error is None and len(o.output_ids) == MAX_NEW and o.finish_reason == "length", o
    # the load reports the router reads: real counters from every engine
    p_load = httpx.get(pd.p.url + "/get_load", timeout=10).json()
    counted = {k: p_load[k] - p_before[k] for k in ("prompt_tokens_total", "step_seconds_total")}
    assert counted["prompt_tokens_total"] >= 32 and counted["step_seconds_total"] > 0, counted  # prefix hits not counted
    for d in pd.decodes:
        d_load = httpx.get(d.url + "/get_load", timeout=10).json()
        assert d_load["max_running_requests"] > 0 and 0 < d_load["kv_free_tokens"] <= d_load["kv_total_tokens"]
        assert pd.r1.workers()[d.url]["load_report"] is not None
    out, _ = _run_and_kill(pd, pd.r1)
    for o, ref in zip(out, undisturbed, strict=True):
        assert o.error is None, o.error
        assert o.status == 200 and o.finish_reason == "length" and o.done_events == 1
        assert o.output_ids == ref.output_ids
    _whole(pd)


def test_kill_decode_without_migration_errors_every_stream(pd: PD) -> None:
    out, t_kill = _run_and_kill(pd, pd.r0)
    for o in out:
        assert o.status == 200 and o.error is not None, o
        assert o.done_at is not None and o.done_at - t_kill <= HEARTBEAT_BOUND_S, o
        assert len(o.output_ids) < MAX_NEW
    _whole(pd)
