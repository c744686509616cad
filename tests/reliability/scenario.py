"""Steps shared by the failure scenarios: prompts, holding a request in a state, checking
outcomes against transformers, and the router's view of a dead / revived worker."""

from __future__ import annotations

import random
from collections.abc import Callable

import httpx

from tests.engine.reference import hf_greedy
from tests.reliability.client import Outcome
from tests.reliability.cluster import VOCAB, Cluster
from tests.reliability.procs import Instance
from tests.server.server_procs import wait_until

StatePred = Callable[[dict[str, float]], bool]


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


def hold(inst: Instance, pred: StatePred, what: str, timeout_s: float = 15.0) -> dict[str, float]:
    """Poll `inst`'s /metrics until `pred` holds; returns the matching snapshot."""
    seen: list[dict[str, float]] = []

    def check() -> bool:
        s = inst.stats()
        seen[:] = [s]
        return pred(s)

    assert wait_until(check, timeout_s, period_s=0.03), f"{inst.name} never reached {what}: {seen}"
    return seen[0]


def assert_correct(model: str, outcomes: list[Outcome], sample: int | None = None) -> None:
    """Every outcome completed, and (a sample of) them equal transformers' greedy output."""
    for o in outcomes:
        assert o.ok, f"request failed or was cut short: prefill={o.prefill} decode={o.decode}"
    for o in outcomes[:sample]:
        assert o.output_ids == hf_greedy(model, o.prompt, o.max_new)


def assert_failed_within(outcomes: list[Outcome], since: float, bound_s: float, *, side: str = "decode",
                         model: str | None = None) -> None:
    """Every outcome still running at `since` ended with an error on `side` at most `bound_s`
    later; one that completed must be exact (needs `model`): its server finished it before the
    fault even where the client read the last bytes just after `since` (a dead instance sends
    nothing). At least half of them must have been caught by the fault, or the case tested nothing."""
    caught = 0
    for o in outcomes:
        s = o.decode if side == "decode" else o.prefill
        if o.ok and o.decode.done_at is not None and model is not None:
            assert o.output_ids == hf_greedy(model, o.prompt, o.max_new), f"finished before the fault, wrong: {o}"
            continue
        assert s.error is not None or s.status >= 400, f"{side} did not report an error: {o}"
        assert s.done_at is not None and s.done_at - since <= bound_s, (
            f"{side} error came {s.done_at and s.done_at - since:.2f}s after the fault (bound {bound_s}s): {s}"
        )
        caught += 1
    assert 2 * caught >= len(outcomes), f"only {caught} of {len(outcomes)} requests were caught by the fault"


def router_routes_around(cluster: Cluster, victim: Instance, model: str, n: int = 6) -> None:
    """The router marks `victim` down, and still serves every request while it is down."""
    cluster.router.wait_worker(victim, healthy=False, timeout_s=15.0)
    check_router_serves(cluster, model, n)


def check_router_serves(cluster: Cluster, model: str, n: int, seed: int = 99) -> None:
    with httpx.Client(timeout=60.0) as client:
        for prompt in prompts(n, 12, seed):
            r = cluster.router.generate(client, prompt, 6)
            assert r.status_code == 200, f"{r.text}\nworkers: {cluster.router.workers()}"
            assert r.json()["output_ids"] == hf_greedy(model, prompt, 6)


def router_recovers(cluster: Cluster, victim: Instance, model: str) -> None:
    """After a restart the router marks `victim` up again and routes to it (round robin)."""
    victim.wait_healthy()
    cluster.router.wait_worker(victim, healthy=True, timeout_s=15.0)
    before = cluster.router.workers()[victim.url]["total_requests"]
    check_router_serves(cluster, model, 4, seed=7)
    assert cluster.router.workers()[victim.url]["total_requests"] > before, "router never routed to the revived worker"
