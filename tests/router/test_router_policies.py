"""Policies, the prefix tree, the circuit breaker and config parsing (in-process; health: test_router_health_state.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.server.generate_response import LoadReport
from router.admission import has_room
from router.breaker import BreakerState, CircuitBreaker
from router.config import RouterConfig
from router.policies import CacheAwarePolicy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy, make_policy
from router.prefix_tree import PrefixTree
from router.worker import Worker


def workers(n: int) -> list[Worker]:
    out = []
    for i in range(n):
        w = Worker(f"http://127.0.0.1:{9000 + i}", "decode", CircuitBreaker(3, 2, 10.0))
        w.health.healthy = True
        out.append(w)
    return out


def test_round_robin_is_exactly_even() -> None:
    ws = workers(3)
    pol = RoundRobinPolicy()
    counts = Counter(pol.select(ws, [1]).url for _ in range(300))
    assert sorted(counts.values()) == [100, 100, 100]


def test_random_is_roughly_uniform() -> None:
    ws = workers(3)
    pol = RandomPolicy(random.Random(0))
    counts = Counter(pol.select(ws, [1]).url for _ in range(3000))
    assert len(counts) == 3 and all(850 <= c <= 1150 for c in counts.values()), counts


def test_power_of_two_prefers_least_loaded() -> None:
    ws = workers(3)
    for w, load in zip(ws, (0, 5, 10), strict=True):
        w.in_flight_requests = load
    pol = PowerOfTwoPolicy(random.Random(0))
    counts = Counter(pol.select(ws, [1]).url for _ in range(3000))
    assert ws[2].url not in counts  # the most loaded never wins a pair
    assert 1800 <= counts[ws[0].url] <= 2200  # the least loaded wins 2 of 3 pairs
    two = ws[:2]
    assert all(pol.select(two, [1]) is ws[0] for _ in range(50))
    ws[0].in_flight_requests = 5
    ws[0].in_flight_tokens, ws[1].in_flight_tokens = 100, 10  # tie on requests: fewer tokens wins
    assert all(pol.select(two, [1]) is ws[1] for _ in range(50))


def test_cache_aware_prefix_affinity() -> None:
    ws = workers(3)
    pol = CacheAwarePolicy(cache_threshold=0.5, balance_abs=4, balance_rel=1.5)
    system = list(range(100, 164))
    first = pol.select(ws, system + [1, 2])
    first.in_flight_requests += 1  # affinity must survive a small load difference
    for tail in range(20):
        assert pol.select(ws, system + [tail, 7]) is first
    # An unrelated prompt goes to the least loaded worker instead.
    other = pol.select(ws, list(range(500, 540)))
    assert other is not first
    pol.tree.check_integrity()


def test_cache_aware_falls_back_to_least_load_when_imbalanced() -> None:
    ws = workers(2)
    pol = CacheAwarePolicy(cache_threshold=0.5, balance_abs=4, balance_rel=1.5)
    prompt = list(range(50))
    hot = pol.select(ws, prompt)
    cold = ws[1] if hot is ws[0] else ws[0]
    hot.in_flight_requests = 5
    cold.in_flight_requests = 1  # 5 - 1 > 4 is false: still balanced -> affinity
    assert pol.select(ws, prompt) is hot
    hot.in_flight_requests = 6  # 6 - 1 > 4 and 6 > 1.5 * 1: imbalanced -> least load
    assert pol.select(ws, prompt) is cold
    # The prompt now lives on both; once balanced again either is a full match.
    hot.in_flight_requests = cold.in_flight_requests = 0
    assert pol.select(ws, prompt) in (hot, cold)


def test_cache_aware_forgets_removed_worker() -> None:
    ws = workers(2)
    pol = CacheAwarePolicy()
    w = pol.select(ws, [1, 2, 3, 4])
    pol.on_worker_removed(w.url)
    assert w.url not in pol.tree.match([1, 2, 3, 4])
    pol.tree.check_integrity()


def test_make_policy_names() -> None:
    for name in ("round_robin", "random", "power_of_two", "cache_aware"):
        assert make_policy(name).name == name
    with pytest.raises(ValueError):
        make_policy("nope")


def test_prefix_tree_split_and_match() -> None:
    t = PrefixTree()
    t.insert([1, 2, 3, 4, 5], "a")
    t.insert([1, 2, 3, 9], "b")
    t.insert([7], "a")
    assert t.match([1, 2, 3, 4, 5, 6]) == {"a": 5, "b": 3}
    assert t.match([1, 2, 3, 9, 9]) == {"a": 3, "b": 4}
    assert t.match([1, 2]) == {"a": 2, "b": 2}
    assert t.match([8]) == {}
    assert t.total_tokens == 5 + 1 + 1
    t.check_integrity()


def test_prefix_tree_eviction_is_bounded_and_lru() -> None:
    t = PrefixTree(max_tokens=100)
    for i in range(50):
        t.insert([i] * 10, "a")
        assert t.total_tokens <= 100
        t.check_integrity()
    assert t.match([49] * 10) == {"a": 10}  # the newest survive
    assert t.match([0] * 10) == {}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.sampled_from("abc")),
                min_size=1, max_size=25),
       st.lists(st.integers(0, 3), max_size=12))
def test_prefix_tree_matches_brute_force(inserts: list[tuple[list[int], str]], query: list[int]) -> None:
    t = PrefixTree()
    for seq, url in inserts:
        t.insert(seq, url)
    t.check_integrity()
    expect: dict[str, int] = {}
    for seq, url in inserts:
        n = 0
        while n < min(len(seq), len(query)) and seq[n] == query[n]:
            n += 1
        if n:
            expect[url] = max(expect.get(url, 0), n)
    assert t.match(query) == expect


def test_breaker_transitions() -> None:
    now = [0.0]
    b = CircuitBreaker(failure_threshold=3, success_threshold=2, open_seconds=5.0, clock=lambda: now[0])
    for _ in range(2):
        b.record_failure()
    assert b.state is BreakerState.CLOSED and b.allows()
    b.record_success()  # resets the count
    for _ in range(3):
        b.record_failure()
    assert b.state is BreakerState.OPEN and not b.allows()
    now[0] = 5.0
    assert b.state is BreakerState.HALF_OPEN and b.allows()
    b.on_dispatch()
    assert not b.allows()  # one trial at a time
    b.record_failure()
    assert b.state is BreakerState.OPEN
    now[0] = 10.0
    b.on_dispatch()
    b.record_success()
    assert b.state is BreakerState.HALF_OPEN and b.allows()
    b.on_dispatch()
    b.record_success()
    assert b.state is BreakerState.CLOSED


def test_config_from_args() -> None:
    cfg = RouterConfig.from_args(["--model-path", "/m", "--prefill", "http://a:1", "8998", "--prefill", "b:2",
                                  "--decode", "http://c:3/", "--policy", "random", "--decode-policy", "round_robin",
                                  "--max-retries", "7"])
    assert [(w.url, w.bootstrap_port) for w in cfg.prefill] == [("http://a:1", 8998), ("http://b:2", None)]
    assert [w.url for w in cfg.decode] == ["http://c:3"]
    assert (cfg.prefill_policy, cfg.decode_policy, cfg.max_retries) == ("random", "round_robin", 7)
    assert cfg.disaggregated
    colo = RouterConfig.from_args(["--model-path", "/m", "--worker", "http://w:1"])
    assert not colo.disaggregated and colo.worker[0].role == "colocated"
    with pytest.raises(ValueError):
        RouterConfig.from_args(["--model-path", "/m", "--worker", "w:1", "--decode", "d:1"])
    with pytest.raises(SystemExit):
        RouterConfig.from_args(["--model-path", "/m", "--prefill", "a:1", "port"])


def _report(**kw: float) -> LoadReport:
    base = {"num_running_reqs": 0, "num_queued_reqs": 0, "num_queued_tokens": 0, "kv_free_tokens": 10_000,
            "kv_total_tokens": 10_000, "max_running_requests": 0, "prompt_tokens_total": 0,
            "step_seconds_total": 0.0}
    return LoadReport(**{**base, **kw})  # type: ignore[arg-type]


def test_load_aware_prefill_prices_queue_rate_and_prefix() -> None:
    slow, fast = workers(2)
    for w, tokens_per_s in ((slow, 100), (fast, 1000)):
        w.live.apply(_report(), 0.0)
        w.live.apply(_report(prompt_tokens_total=1000, step_seconds_total=1000 / tokens_per_s), 1.0)
    assert slow.live.prefill_rate == pytest.approx(100) and fast.live.prefill_rate == pytest.approx(1000)
    pol = make_policy("load_aware", role="prefill")
    prompt = list(range(500))
    assert pol.select([slow, fast], prompt) is fast  # 0.5 s against 5 s
    fast.live.apply(_report(num_queued_tokens=10_000, prompt_tokens_total=1000, step_seconds_total=1.0), 2.0)
    assert pol.select([slow, fast], list(range(1000, 1500))) is slow  # 10.5 s queued against 5 s
    # the slow worker now holds that prompt's prefix: a request sharing it costs it ~nothing
    slow.live.apply(_report(num_queued_tokens=0, prompt_tokens_total=1000, step_seconds_total=10.0), 3.0)
    fast.live.apply(_report(num_queued_tokens=0, prompt_tokens_total=1000, step_seconds_total=1.0), 3.0)
    assert pol.select([slow, fast], [*range(1000, 1500), 7]) is slow  # 1 token at 100/s beats 501 at 1000/s
    # sent since the report counts as queued
    fast.acquire(100_000)
    assert pol.select([slow, fast], list(range(2000, 2100))) is slow


def test_load_aware_decode_and_room() -> None:
    d1, d2 = workers(2)
    d1.live.apply(_report(num_running_reqs=5), 0.0)
    d2.live.apply(_report(num_running_reqs=2, num_queued_reqs=1), 0.0)
    pol = make_policy("load_aware", role="decode")
    assert pol.select([d1, d2], [1, 2]) is d2
    d2.acquire(10)
    d2.acquire(10)
    d2.acquire(10)
    assert pol.select([d1, d2], [1, 2]) is d1  # 2 + 1 + 3 sent since > 5
    d1.live.apply(_report(max_running_requests=2, kv_free_tokens=300, kv_total_tokens=1000), 1.0)
    assert has_room(d1, 300)
    assert not has_room(d1, 301)  # free KV
    assert has_room(d1, 5000)  # can never fit: decode itself answers
    d1.acquire(1)
    d1.acquire(1)
    assert not has_room(d1, 1)  # max running
    assert has_room(workers(1)[0], 10**9)  # never reported: no gating
