"""Orders the waiting queue before each prefill round (--schedule-policy)."""

from __future__ import annotations

import random
from collections.abc import Callable

from common.scheduler.req import Req

# A waiting request that shares this many uncached leading tokens with another waiting
# request is deprioritized for one round: the other computes them and it then hits the cache.
IN_BATCH_DEDUP_TOKENS = 32

PrefixMatcher = Callable[[list[int]], int]  # fill ids -> cached prefix length


class SchedulePolicy:
    def __init__(self, policy: str, *, lpm_fcfs_fallback: int = 128, seed: int = 0) -> None:
        self.policy = policy
        self.lpm_fcfs_fallback = lpm_fcfs_fallback
        self.rng = random.Random(seed)

    def order(self, waiting: list[Req], match_len: PrefixMatcher) -> list[Req]:
        """Returns the waiting requests in the order the PrefillAdder should try them.
        Retracted requests always go first (they already hold client streams open)."""
        retracted = [r for r in waiting if r.state.value == "retracted"]
        fresh = [r for r in waiting if r.state.value != "retracted"]
        policy = self.policy
        if policy == "lpm" and len(fresh) > self.lpm_fcfs_fallback:
            policy = "fcfs"
        if policy == "lpm":
            prefix = {id(r): match_len(r.fill_ids) for r in fresh}
            fresh.sort(key=lambda r: -prefix[id(r)])
            fresh = self._dedup(fresh, prefix)
        elif policy == "lof":
            fresh.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == "random":
            self.rng.shuffle(fresh)
        elif policy == "priority":
            fresh.sort(key=lambda r: (-r.priority, r.arrival_time))
        return retracted + fresh

    @staticmethod
    def _dedup(ordered: list[Req], prefix: dict[int, int]) -> list[Req]:
        seen: set[tuple[int, ...]] = set()
        first: list[Req] = []
        later: list[Req] = []
        for r in ordered:
            start = prefix[id(r)]
            ids = r.fill_ids
            if len(ids) - start <= IN_BATCH_DEDUP_TOKENS:
                first.append(r)
                continue
            key = tuple(ids[: start + IN_BATCH_DEDUP_TOKENS])
            if key in seen:
                later.append(r)
            else:
                seen.add(key)
                first.append(r)
        return first + later
