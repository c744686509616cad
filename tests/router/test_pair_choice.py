"""PD pair choice from KV events and sessions (router/pair_choice.py), and cache_aware's exact match:
a registry of real Worker objects, with what each decode caches given as a table (what KVIndexes
would answer from the workers' KV events)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from common.cache.kv_events import PromptHashes
from router.config import RouterConfig
from router.errors import ApiError
from router.health_state import ProbeOutcome
from router.pair_choice import PairChooser, SessionAffinity, session_key
from router.plan import GenerationPlan
from router.registry import WorkerRegistry
from router.worker import CacheInfo, Worker

OK = ProbeOutcome("ok")
PROMPT = list(range(100))


class CacheTable:
    """url -> cached tokens of PROMPT (absent: the worker publishes no KV events)."""

    def __init__(self) -> None:
        self.cached: dict[str, int] = {}

    def __call__(self, worker: Worker, ids: Sequence[int], memo: dict[int, PromptHashes]) -> int | None:
        return self.cached.get(worker.url)


def setup(n_decode: int = 3, local_max: int = 32, *extra: str) -> tuple[WorkerRegistry, PairChooser, CacheTable]:
    cfg = RouterConfig.from_args(["--model-path", "/m", "--prefill", "http://p:1", "9000", "--decode-policy",
                                  "round_robin", *extra,
                                  *[a for i in range(n_decode) for a in ("--decode", f"http://d{i}:1")]])
    table = CacheTable()
    reg = WorkerRegistry(cfg, table)
    for w in reg.all():
        w.health.record(OK, cfg.health, now=0.0)
        w.cache_info = CacheInfo("tcp://127.0.0.1:1", local_max if w.role == "decode" else 0)
    return reg, PairChooser(cfg, reg, table), table


def plan(session: str | None = None, ids: list[int] = PROMPT, **kw: object) -> GenerationPlan:
    return GenerationPlan("generate", "m", ids, {"max_new_tokens": 8}, False, session_id=session, **kw)  # type: ignore[arg-type]


def decode(reg: WorkerRegistry, i: int) -> Worker:
    w = reg.get(f"http://d{i}:1")
    assert w is not None
    return w


def test_without_cache_or_session_the_policy_picks_and_prefill_runs() -> None:
    reg, chooser, _ = setup()
    picks = [chooser.choose(plan(), frozenset()) for _ in range(3)]
    assert [p.decode.url for p in picks] == [f"http://d{i}:1" for i in range(3)]  # round robin
    assert all(p.reason == "policy" and p.prefill is not None and p.cached_tokens is None for p in picks)


def test_the_decode_holding_most_of_the_prompt_wins_and_a_short_suffix_stays_there() -> None:
    reg, chooser, table = setup()
    table.cached = {"http://d0:1": 40, "http://d1:1": 80, "http://d2:1": 0}
    p = chooser.choose(plan(), frozenset())
    assert (p.decode.url, p.reason, p.cached_tokens, p.prefill) == ("http://d1:1", "cache", 80, None)
    table.cached["http://d1:1"] = 64  # 36 uncached > local max 32: prefill sends the missing pages
    p = chooser.choose(plan(), frozenset())
    assert p.decode.url == "http://d1:1" and p.prefill is not None
    table.cached = {"http://d0:1": 40}  # below cache_threshold (0.5 of 100): the policy decides
    assert chooser.choose(plan(), frozenset()).reason == "policy"


def test_prompt_logprobs_never_skip_prefill() -> None:
    reg, chooser, table = setup()
    table.cached = {"http://d0:1": 96}
    assert chooser.choose(plan(prompt_logprob_start=0), frozenset()).prefill is not None
    assert chooser.choose(plan(), frozenset()).prefill is None


def test_a_session_sticks_to_its_decode_until_it_is_overloaded_or_excluded() -> None:
    reg, chooser, table = setup()
    first = chooser.choose(plan("s"), frozenset()).decode
    table.cached = {w.url: 90 for w in reg.of_role("decode") if w is not first}  # cache elsewhere: session wins
    p = chooser.choose(plan("s"), frozenset())
    assert p.decode is first and p.reason == "session"
    second = chooser.choose(plan("s"), frozenset({first.url})).decode  # a retry goes elsewhere
    assert second is not first
    assert chooser.choose(plan("s"), frozenset()).decode is second, "the session follows where it was served"
    for _ in range(40):
        second.acquire(1)  # 40 in flight vs 0: over balance_abs (32) and balance_rel
    p = chooser.choose(plan("s"), frozenset())
    assert p.decode is not second and p.reason == "cache"


def test_no_decode_is_a_503() -> None:
    reg, chooser, _ = setup(n_decode=1)
    decode(reg, 0).removed = True
    with pytest.raises(ApiError) as e:
        chooser.choose(plan(), frozenset())
    assert e.value.status == 503


def test_session_affinity_is_bounded_and_keys_are_bounded() -> None:
    aff = SessionAffinity(max_sessions=2)
    for s in "abc":
        aff.remember(s, "u-" + s)
    assert len(aff) == 2 and aff.get("a") is None and aff.get("c") == "u-c"
    assert len(session_key("x" * 256)) == 24
    with pytest.raises(ApiError):
        session_key("x" * 257)
    with pytest.raises(ApiError):
        session_key(7)


def test_cache_aware_trusts_kv_events_over_what_it_sent() -> None:
    reg, _, table = setup(1, 32, "--prefill", "http://p2:1", "9001")
    p1, p2 = reg.of_role("prefill")
    policy = reg.policies["prefill"]
    assert policy.select([p1, p2], PROMPT) is p1  # nothing known: least loaded, first; its tree gets the prompt
    assert policy.select([p1, p2], PROMPT) is p1  # the guess: p1 was sent this prompt
    table.cached = {p1.url: 0, p2.url: 96}  # p1 evicted it, p2 holds it (its events say so)
    assert policy.select([p1, p2], PROMPT) is p2
