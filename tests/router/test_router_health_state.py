"""The router's health state machine, panic routing and health config (in-process, no I/O).

Slow is not dead: a probe timeout raises the load estimate, a worker that answered
requests since the last probe is alive whatever the probe says, only refused/reset/5xx
(or a long silence) mark a worker down, and a role whose workers are all down by
probes alone is still routed to.
"""

from __future__ import annotations

import pytest

from common.server.liveness import HEALTH_ANSWER_BOUND_S
from router.breaker import CircuitBreaker
from router.config import HealthConfig, RouterConfig, replace
from router.errors import ApiError
from router.health_state import HealthState, ProbeOutcome
from router.registry import WorkerRegistry
from router.worker import Worker

CFG = HealthConfig(interval_s=1.0, probe_timeout_s=0.5, failure_threshold=2, success_threshold=2,
                   unresponsive_after_s=10.0, pair_probe_timeout_s=5.0)
OK = ProbeOutcome("ok")
TIMEOUT = ProbeOutcome("timeout", "no answer within 0.5s")
REFUSED = ProbeOutcome("refused", "ConnectError")
STATUS_503 = ProbeOutcome("status", "/health returned 503: engine hung")


def up_state() -> HealthState:
    h = HealthState()
    assert h.record(OK, CFG, now=0.0) == "up"  # a new worker: its first answer decides at once
    return h


def test_failure_and_success_thresholds() -> None:
    h = up_state()
    assert h.record(REFUSED, CFG, now=1.0) is None and h.healthy
    assert h.record(REFUSED, CFG, now=2.0) == "down" and h.down_kind == "refused"
    assert h.record(OK, CFG, now=3.0) is None and not h.healthy
    assert h.record(OK, CFG, now=4.0) == "up" and h.down_kind is None and h.last_error is None


def test_probe_timeouts_raise_load_not_down() -> None:
    h = up_state()
    w = Worker("http://127.0.0.1:1", "decode", CircuitBreaker(3, 2, 10.0))
    w.health = h
    for k in range(1, 7):
        assert h.record(TIMEOUT, CFG, now=float(k)) is None
        assert h.healthy and h.consecutive_failures == 0
    assert h.consecutive_timeouts == 6
    assert w.load == CFG.max_slow_probes * CFG.slow_probe_load  # capped
    assert "slow, not down" in (h.last_error or "")
    assert h.record(OK, CFG, now=7.0) is None and w.load == 0


def test_silence_past_unresponsive_after_marks_down_at_once() -> None:
    h = up_state()
    assert h.record(TIMEOUT, CFG, now=9.9) is None and h.healthy
    assert h.record(TIMEOUT, CFG, now=10.0) == "down"  # one verdict suffices: it stands for 10 s of silence
    assert h.down_kind == "unresponsive" and "no answer to probes or requests for 10.0s" in (h.last_error or "")
    assert not h.panic_routable  # silence is not an answer: no panic routing to it


def test_request_progress_since_last_probe_beats_any_probe_result() -> None:
    h = up_state()
    for k, bad in enumerate((REFUSED, STATUS_503, REFUSED, TIMEOUT), start=1):
        progress_at = k - 0.5  # an event streamed between the previous probe and this one
        assert h.record(bad, CFG, now=float(k), progress_at=progress_at) is None
        assert h.healthy and h.consecutive_failures == 0
    assert "ignored: the worker answered requests since" in (h.last_error or "")
    # Progress keeps a timing-out worker from ever turning unresponsive.
    for k in range(5, 40):
        h.record(TIMEOUT, CFG, now=float(k), progress_at=k - 0.5)
    assert h.healthy
    # Old progress (before the previous probe) proves nothing now.
    assert h.record(REFUSED, CFG, now=40.0, progress_at=38.5) is None
    assert h.record(REFUSED, CFG, now=41.0, progress_at=38.5) == "down"


def test_progress_brings_a_down_worker_back() -> None:
    h = up_state()
    h.record(STATUS_503, CFG, now=1.0)
    assert h.record(STATUS_503, CFG, now=2.0) == "down" and h.panic_routable
    h.record(STATUS_503, CFG, now=3.0, progress_at=2.5)
    assert h.record(STATUS_503, CFG, now=4.0, progress_at=3.5) == "up"


def test_a_new_worker_that_never_answers_stays_unrouted() -> None:
    h = HealthState()
    assert h.record(TIMEOUT, CFG, now=0.0) is None and not h.healthy and not h.checked
    assert h.record(TIMEOUT, CFG, now=10.0) is None and h.down_kind == "unresponsive"
    assert h.record(OK, CFG, now=11.0) is None  # the silence was a verdict: success_threshold applies
    assert h.record(OK, CFG, now=12.0) == "up"


def registry(n_decode: int) -> WorkerRegistry:
    cfg = RouterConfig.from_args(["--model-path", "/m", "--prefill", "http://p:1", "9000",
                                  *[a for i in range(n_decode) for a in ("--decode", f"http://d{i}:1")]])
    reg = WorkerRegistry(cfg)
    for w in reg.all():
        w.health.record(OK, CFG, now=0.0)
    return reg


def mark_down(w: Worker, outcome: ProbeOutcome) -> None:
    w.health.record(outcome, CFG, now=1.0)
    w.health.record(outcome, CFG, now=2.0)
    assert not w.health.healthy


def test_panic_routing_when_every_worker_of_a_role_is_down_by_probes() -> None:
    reg = registry(2)
    d0, d1 = reg.of_role("decode")
    mark_down(d0, STATUS_503)
    assert reg.select("decode", [1]) is d1  # a healthy one left: no panic
    mark_down(d1, ProbeOutcome("reset", "RemoteProtocolError"))
    assert reg.select("decode", [1]) in (d0, d1)
    assert reg.panic_picks["decode"] == 1
    # A refused connection is a dead process: no panic to it.
    mark_down(d1, REFUSED)
    assert {reg.select("decode", [1]).url for _ in range(5)} == {d0.url}
    # An open breaker (requests really failing) also takes a worker out of panic routing.
    for _ in range(d0.breaker.failure_threshold):
        d0.breaker.record_failure()
    with pytest.raises(ApiError) as e:
        reg.select("decode", [1])
    assert e.value.status == 503 and "no healthy decode worker" in e.value.message


def test_health_config_is_derived_and_validated() -> None:
    cfg = RouterConfig.from_args(["--model-path", "/m", "--worker", "w:1"])
    h = cfg.health
    assert h.probe_timeout_s > HEALTH_ANSWER_BOUND_S
    assert h.unresponsive_after_s == cfg.health_failure_threshold * (h.interval_s + h.probe_timeout_s)
    assert replace(cfg, health_unresponsive_timeout=7.0).health.unresponsive_after_s == 7.0
    with pytest.raises(ValueError, match="longer than a worker's own /health bound"):
        replace(cfg, health_check_timeout=HEALTH_ANSWER_BOUND_S)
    with pytest.raises(ValueError, match="health_unresponsive_timeout"):
        replace(cfg, health_unresponsive_timeout=cfg.health_check_timeout)
