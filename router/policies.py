"""Load-balancing policies: pick one worker among the available candidates.

One policy object per role (prefill, decode, colocated). `select` is called on the
event loop with a non-empty list of available workers; it must be cheap.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from common.cache.kv_events import PromptHashes
from router.prefix_tree import PrefixTree
from router.worker import Worker

# (worker, prompt, memo) -> leading prompt tokens the worker holds now, None when unknown (KVIndexes.cached_tokens)
ExactMatch = Callable[[Worker, Sequence[int], dict[int, PromptHashes]], "int | None"]


class Policy(ABC):
    name: str

    @abstractmethod
    def select(self, candidates: Sequence[Worker], input_ids: Sequence[int]) -> Worker:
        """Choose one of `candidates` (non-empty, all available) for a request with these tokens."""

    def on_worker_removed(self, url: str) -> None:  # noqa: B027 (optional hook)
        """Drop any state kept for `url`."""


def _least_loaded(candidates: Sequence[Worker]) -> Worker:
    return min(candidates, key=lambda w: (w.load, w.in_flight_tokens))


def imbalanced(worker: Worker, candidates: Sequence[Worker], balance_abs: int, balance_rel: float) -> bool:
    """`worker` is loaded well above the least loaded candidate: by more than balance_abs requests
    AND by more than balance_rel times (the cache_aware policy's rule)."""
    lo = min(w.load for w in candidates)
    return worker.load - lo > balance_abs and worker.load > balance_rel * lo


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def select(self, candidates: Sequence[Worker], input_ids: Sequence[int]) -> Worker:
        w = candidates[self._next % len(candidates)]
        self._next += 1
        return w


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Worker], input_ids: Sequence[int]) -> Worker:
        return self._rng.choice(candidates)


class PowerOfTwoPolicy(Policy):
    """Sample two distinct workers, take the less loaded (in-flight requests + slow-probe penalty, then tokens)."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def select(self, candidates: Sequence[Worker], input_ids: Sequence[int]) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(list(candidates), 2)
        return _least_loaded((a, b))


class CacheAwarePolicy(Policy):
    """Prefix affinity while the load is balanced, least load when it is not.

    Imbalanced when max_load - min_load > balance_abs AND max_load > balance_rel * min_load
    (loads = in-flight requests). Otherwise the worker with the longest matched prefix wins
    if match/len(prompt) >= cache_threshold; else the least loaded. The chosen worker's
    tree gets the prompt either way. The match is exact for a worker that publishes KV
    events (`exact_match`, router/kv_index.py: what its cache holds now), else the tree's
    guess from what was sent to it (which drifts once the worker evicts).
    """

    name = "cache_aware"

    def __init__(
        self,
        cache_threshold: float = 0.5,
        balance_abs: int = 32,
        balance_rel: float = 1.5,
        max_tree_tokens: int = 1 << 20,
        exact_match: ExactMatch | None = None,
    ) -> None:
        self.exact_match = exact_match
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.tree = PrefixTree(max_tree_tokens)

    def select(self, candidates: Sequence[Worker], input_ids: Sequence[int]) -> Worker:
        busiest = max(candidates, key=lambda w: w.load)
        if len(candidates) > 1 and imbalanced(busiest, candidates, self.balance_abs, self.balance_rel):
            chosen = _least_loaded(candidates)
        else:
            matched = self.tree.match(input_ids) if input_ids else {}
            if self.exact_match is not None and input_ids:
                memo: dict[int, PromptHashes] = {}
                for w in candidates:
                    exact = self.exact_match(w, input_ids, memo)
                    if exact is not None:
                        matched[w.url] = exact
            best = max(candidates, key=lambda w: (matched.get(w.url, 0), -w.load))
            hit = matched.get(best.url, 0)
            if input_ids and hit / len(input_ids) >= self.cache_threshold:
                chosen = best
            else:
                chosen = _least_loaded(candidates)
        if input_ids:
            self.tree.insert(input_ids, chosen.url)
        return chosen

    def on_worker_removed(self, url: str) -> None:
        self.tree.remove_worker(url)


class LoadAwarePolicy(Policy):
    """Least predicted time to first token, from the workers' own load reports (router/live_load.py).

    Prefill (and colocated) workers: predicted TTFT = (queued prompt tokens + this prompt - the
    prefix it already holds) / its measured prefill rate, where queued = its last report plus
    what this router sent it since, and the prefix hit comes from a prefix tree of what was sent
    to it, or exactly from its KV events where known (as cache_aware). A worker whose rate is
    not measured yet gets the mean of the measured ones (all unmeasured: rates equal, so fewest
    tokens wins). A worker that never reported
    counts this router's in-flight tokens instead.
    Decode workers: the registry offers only those with room when any has (router/admission.py);
    among them the fewest requests (reported running + queued + sent since; else in flight).
    The pair is priced as the sum of the two, which no other choice couples, so each role's
    minimum is the pair's.
    """

    name = "load_aware"

    def __init__(self, role: str, max_tree_tokens: int = 1 << 20, exact_match: ExactMatch | None = None) -> None:
        self.role = role
        self.exact_match = exact_match
        self.tree = PrefixTree(max_tree_tokens) if role != "decode" else None

    def select(self, candidates: Sequence[Worker], input_ids: Sequence[int]) -> Worker:
        if self.tree is None:
            return min(candidates, key=_decode_cost)
        matched = self.tree.match(input_ids) if input_ids and len(candidates) > 1 else {}
        if self.exact_match is not None and input_ids and len(candidates) > 1:
            memo: dict[int, PromptHashes] = {}
            for w in candidates:
                exact = self.exact_match(w, input_ids, memo)
                if exact is not None:
                    matched[w.url] = exact
        rates = [r for w in candidates if (r := w.live.prefill_rate)]
        default_rate = sum(rates) / len(rates) if rates else 1.0
        n = len(input_ids)

        def ttft(w: Worker) -> tuple[float, int]:
            queued = w.live.queued_tokens if w.live.report is not None else w.in_flight_tokens
            work = max(0, queued + n - matched.get(w.url, 0))
            return work / (w.live.prefill_rate or default_rate), w.load

        chosen = min(candidates, key=ttft)
        if input_ids:
            self.tree.insert(input_ids, chosen.url)
        return chosen

    def on_worker_removed(self, url: str) -> None:
        if self.tree is not None:
            self.tree.remove_worker(url)


def _decode_cost(w: Worker) -> tuple[int, int]:
    r = w.live.report
    if r is None:
        return w.load, w.in_flight_tokens
    return r.num_running_reqs + r.num_queued_reqs + w.live.sent_reqs + w.health.load_penalty, w.in_flight_tokens


def make_policy(
    name: str,
    *,
    role: str = "decode",
    cache_threshold: float = 0.5,
    balance_abs: int = 32,
    balance_rel: float = 1.5,
    max_tree_tokens: int = 1 << 20,
    exact_match: ExactMatch | None = None,
) -> Policy:
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "random":
        return RandomPolicy()
    if name == "power_of_two":
        return PowerOfTwoPolicy()
    if name == "cache_aware":
        return CacheAwarePolicy(cache_threshold, balance_abs, balance_rel, max_tree_tokens, exact_match)
    if name == "load_aware":
        return LoadAwarePolicy(role, max_tree_tokens, exact_match)
    raise ValueError(f"unknown policy {name!r}")
