"""kill -9 a prefill or a decode instance while requests sit in each state.

Each case forces requests into one state on the victim (checked on its /metrics), kills the
victim's whole process group, and then checks:
- every affected client gets an error within the heartbeat bound (no hang);
- every unaffected request (other instances, or already past the victim) completes with
  transformers' greedy tokens;
- the router marks the victim down and keeps serving, then marks it up again and routes
  to it once the victim is restarted on the same ports;
- every pool on every instance is whole at idle (decode holds the pages of a transfer a
  dead prefill may still have been writing until the drain timeout).

A state is forced, never caught by luck: by sizes (more requests or tokens than the decode
has slots or pages for), by the injected post delay (p_slow: each chunk's post takes >= 40 ms,
a lower bound that load only lengthens), by holding p_slow's link (no transfer completes while
the case runs), or by freezing (SIGSTOP) the peer that would move the
requests on, re-reading the state after the freeze and killing before the thaw. No case is
retried: a miss is a bug in the case or the code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

from tests.engine.reference import hf_greedy
from tests.reliability.client import Batch, Job, RouterBatch, RouterOutcome
from tests.reliability.cluster import HEARTBEAT_BOUND_S, HOLD_FILE, Cluster
from tests.reliability.procs import Instance
from tests.reliability.scenario import (
    StatePred,
    assert_correct,
    assert_failed_within,
    hold,
    prompts,
    router_recovers,
    router_routes_around,
)


@dataclass(frozen=True)
class Case:
    victim: str
    state: StatePred
    affected: Callable[[Cluster], list[Job]]
    unaffected: Callable[[Cluster], list[Job]]
    # (instance, predicate) that must hold before the affected requests are sent
    before: Callable[[Cluster], tuple[Instance, StatePred]] | None = None
    # SIGSTOPped once the state holds (it cannot move the requests on), SIGCONTed after the kill
    freeze: str | None = None
    prefill_verdict: bool = False  # the prefill side must fail by itself (client does not cancel it)
    drains: str | None = None  # the decode that holds the affected pages until the drain timeout
    hold_link: bool = False  # p_slow's transfers stay unconfirmed from the affected requests to the kill
    # streaming requests through the router during the kill: "retried" = every one completes
    # exactly (the failure came before any byte reached the client, so the router re-picked);
    # "cut" = each completes exactly or ends with an in-band error within the bound;
    # "migrated" = every one completes exactly, those on the victim moved to the other decode
    router: tuple[str, int, int, int] | None = None  # (expectation, n, prompt length, max_new)


def _jobs(p: Instance, d: Instance, n: int, length: int, max_new: int, seed: int, *,
          cancel_prefill: bool = True) -> list[Job]:
    return [Job(p, d, pr, max_new, cancel_prefill) for pr in prompts(n, length, seed)]


PREFILL_CASES = {
    # d_small is full of requests prefilled elsewhere: the victim's requests wait in its
    # bootstrap queue (decode sent no page ids yet); the blockers must finish.
    "bootstrapping": Case(
        "p_fast",
        state=lambda s: s["num_bootstrap_queue_reqs"] >= 3,
        affected=lambda c: _jobs(c.p_fast, c.d_small, 3, 40, 8, seed=1),
        unaffected=lambda c: _jobs(c.p_slow, c.d_small, 8, 20, 600, seed=2),
        # all 8 blockers are on d_small (its max running, nothing else there): a later request
        # queues behind them (prealloc is FIFO) and behind the 8 slots they hold, and no slot
        # frees before a blocker's 600 tokens are out (a retracted one blocks admission too)
        before=lambda c: (c.d_small, lambda s: s["num_prealloc_queue_reqs"] + s["num_transfer_queue_reqs"]
                          + s["num_running_reqs"] + s["num_retracted_reqs"] >= 8),
    ),
    # long prompts, 16-token prefill steps: the victim is still computing when it dies.
    "computing": Case(
        "p_fast",
        state=lambda s: s["num_chunked_reqs"] >= 1,
        affected=lambda c: _jobs(c.p_fast, c.d_big, 6, 900, 4, seed=3),
        unaffected=lambda c: _jobs(c.p_slow, c.d_big, 3, 100, 16, seed=4),
        drains="d_big",
    ),
    # p_slow's link is held (HOLD_FILE): no transfer of it completes, so every computed prompt
    # waits in the inflight queue until the kill (a 40 ms post delay alone lost that race on a
    # loaded box: prompts computed slower than their posts drained).
    "transferring": Case(
        "p_slow",
        state=lambda s: s["num_inflight_queue_reqs"] >= 6,  # some of them routed, most of them affected
        hold_link=True,
        affected=lambda c: _jobs(c.p_slow, c.d_big, 6, 160, 4, seed=5),
        unaffected=lambda c: _jobs(c.p_fast, c.d_big, 3, 64, 16, seed=6),
        drains="d_big",
        router=("retried", 4, 160, 8),
    ),
}

DECODE_CASES = {
    "prealloc": Case(
        "d_small",
        state=lambda s: s["num_prealloc_queue_reqs"] >= 2,
        affected=lambda c: _jobs(c.p_fast, c.d_small, 10, 30, 200, seed=11),
        unaffected=lambda c: _jobs(c.p_fast, c.d_big, 3, 32, 16, seed=12),
    ),
    # prefill must notice on its own (heartbeat / NIXL error) and free its pages; the same
    # prefill keeps serving another decode.
    "transferring": Case(
        "d_small",
        state=lambda s: s["num_transfer_queue_reqs"] >= 3,  # all three handed their pages to prefill
        # 12 chunks + aux each, >= 40 ms per post: the window lasts >= 0.5 s; 3 x 48 pages fit d_small
        affected=lambda c: _jobs(c.p_slow, c.d_small, 3, 192, 4, seed=13, cancel_prefill=False),
        unaffected=lambda c: _jobs(c.p_slow, c.d_big, 3, 64, 8, seed=14),
        prefill_verdict=True,
        freeze="p_slow",  # no transfer completes between the last look and the kill
    ),
    "decoding": Case(
        "d_big",
        # the 4 affected and at least one routed request (else none is cut)
        state=lambda s: s["num_running_reqs"] >= 5,
        affected=lambda c: _jobs(c.p_fast, c.d_big, 4, 20, 900, seed=15),
        unaffected=lambda c: _jobs(c.p_fast, c.d_small, 3, 20, 16, seed=16),
        router=("migrated", 4, 20, 400),
    ),
    "retracted": Case(
        "d_small",
        state=lambda s: s["num_retracted_reqs"] >= 1,
        affected=lambda c: _jobs(c.p_fast, c.d_small, 8, 30, 300, seed=17),
        unaffected=lambda c: _jobs(c.p_fast, c.d_big, 3, 20, 16, seed=18),
    ),
}


def _run(c: Cluster, case: Case, model: str, state_name: str) -> None:
    victim: Instance = getattr(c, case.victim)
    unaffected = Batch(case.unaffected(c))
    if case.before is not None:
        inst, pred = case.before(c)
        hold(inst, pred, "the precondition")
    if case.hold_link:
        HOLD_FILE.touch()
    try:
        _run_affected(c, case, model, state_name, victim, unaffected)
    finally:
        HOLD_FILE.unlink(missing_ok=True)


def _run_affected(c: Cluster, case: Case, model: str, state_name: str, victim: Instance, unaffected: Batch) -> None:
    affected = Batch(case.affected(c))
    routed = None
    if case.router is not None:
        _, n, length, max_new = case.router
        routed = RouterBatch(c.router.url, [(p, max_new) for p in prompts(n, length, seed=31)])
    hold(victim, case.state, state_name)
    frozen: Instance | None = getattr(c, case.freeze) if case.freeze is not None else None
    if frozen is not None:
        frozen.sigstop()
    try:
        for _ in range(2 if frozen is not None else 0):  # the second answer comes a whole engine loop later
            snap = victim.stats()
            assert case.state(snap), f"{victim.name} left {state_name} before {frozen and frozen.name} froze: {snap}"
        t_kill = time.monotonic()
        victim.kill9()
    finally:
        if frozen is not None:
            frozen.sigcont()
        HOLD_FILE.unlink(missing_ok=True)  # the restarted victim and the survivors run unheld
    hit = affected.wait()
    assert_failed_within(hit, t_kill, HEARTBEAT_BOUND_S, side="decode", model=model)
    if case.prefill_verdict:
        assert_failed_within(hit, t_kill, HEARTBEAT_BOUND_S, side="prefill", model=model)
    if case.drains is not None:
        held = getattr(c, case.drains).stats()
        assert held["num_draining_reqs"] >= 1 and held["kv_pages_in_use"] > 0, "pages a dead prefill wrote were freed"
    if routed is not None:
        _check_routed(case, routed.wait(), t_kill, model, c.router.url)
    # Before the restart: a victim that is back before the router's probe saw it down (the
    # survivors' long jobs can outlast a restart) would leave nothing to observe.
    router_routes_around(c, victim, model)
    victim.restart()  # boots while the survivors are checked
    assert_correct(model, unaffected.wait(), sample=2)
    router_recovers(c, victim, model)
    c.wait_whole_but_drains(drain_from=t_kill)


def _check_routed(case: Case, outcomes: list[RouterOutcome], t_kill: float, model: str, router_url: str) -> None:
    assert case.router is not None
    cut = 0
    for o in outcomes:
        if o.error is None:
            assert o.output_ids == hf_greedy(model, o.prompt, o.max_new)
            continue
        assert case.router[0] == "cut", f"the router did not retry or migrate the stream: {o.error}"
        assert o.status == 200 and o.done_at is not None and o.done_at - t_kill <= HEARTBEAT_BOUND_S, o
        cut += 1
    if case.router[0] == "cut":
        assert cut >= 1, "no routed request was on the killed decode"
    if case.router[0] == "migrated":
        text = httpx.get(router_url + "/metrics", timeout=10).text
        assert any(line.startswith("router_migrations_total") and float(line.split()[-1]) >= 1
                   for line in text.splitlines()), "no routed request was on the killed decode"


@pytest.mark.parametrize("state", list(PREFILL_CASES))
def test_kill_prefill(whole_cluster: Cluster, tiny_llama_path: str, state: str) -> None:
    _run(whole_cluster, PREFILL_CASES[state], tiny_llama_path, state)


@pytest.mark.parametrize("state", list(DECODE_CASES))
def test_kill_decode(whole_cluster: Cluster, tiny_llama_path: str, state: str) -> None:
    _run(whole_cluster, DECODE_CASES[state], tiny_llama_path, state)
