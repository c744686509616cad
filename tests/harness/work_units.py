"""How launch/test.sh's xdist workers share a tier: work units handed out longest first.

A work unit is a test file (--dist loadfile: a file's module-scoped clusters stay in one
process), or the TINY_CLUSTER_PATHS files together (they share the session's tiny_cluster, so
one worker starts it). xdist hands out units in order of their test count, so a file with one
long test (lm_eval, the transfer bench, the 64-chat health load: 20-40 s each) came last and
one worker ran it alone while the other had finished. `longest_first` orders the collection by
each unit's expected seconds (KNOWN_SECONDS, else its test count times SECONDS_PER_TEST): the
longest-processing-time-first rule: the units handed out last, when a worker may be left
alone, are the short ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol, TypeVar

TINY_CLUSTER_PATHS = ("bench/test_soak.py", "compat/", "grammar/test_grammar_e2e.py",
                      "router/test_router_real.py")
TINY_CLUSTER_UNIT = "tiny_cluster"

# Seconds a unit took (setup + calls + teardown) in a tier run on 2 xdist workers, Intel Xeon
# (AMX), 2026-11-27; the compile tests with inductor's cache cold, as on a fresh CI machine.
# Only units of 15 s or more: the rest are ordered by their test count.
KNOWN_SECONDS = {
    TINY_CLUSTER_UNIT: 120.0,
    "engine/test_engine_parity.py": 80.0,
    "model/test_int8_linear.py": 75.0,
    "pd/test_pd_tp.py": 75.0,
    "pd/test_pd_e2e.py": 73.0,
    "pd/test_pd_transfer_deadline.py": 57.0,
    "grammar/test_grammar_real_model.py": 48.0,
    "router/test_router_faults.py": 39.0,
    "server/test_real_engine.py": 35.0,
    "router/test_router_health_real.py": 32.0,
    "security/test_control_plane.py": 31.0,
    "security/test_slow_clients.py": 30.0,
    "pd/test_pd_router_multiturn.py": 28.0,
    "k8s/test_discovery.py": 28.0,
    "engine/test_tensor_parallel.py": 24.0,
    "router/test_router_health_load.py": 24.0,
    "kv_transfer/test_bench_quick.py": 24.0,
    "security/test_overload.py": 23.0,
    "security/test_low_findings.py": 21.0,
    "pd/test_pd_watchdog.py": 21.0,
    "server/test_instance_lifecycle.py": 21.0,
    "launch/test_pd_launch_local.py": 21.0,
    "kv_transfer/test_kill.py": 19.0,
    "kv_transfer/test_failures.py": 19.0,
    "model/test_default_model.py": 19.0,
    "model/test_flashinfer_backend.py": 17.0,
    "pd/test_pd_aborts.py": 17.0,
    "pd/test_prefill_onednn_cache.py": 15.0,
}
SECONDS_PER_TEST = 0.3  # a unit test's typical cost; units not in KNOWN_SECONDS


class _Item(Protocol):
    @property
    def nodeid(self) -> str: ...


ItemT = TypeVar("ItemT", bound=_Item)


def in_paths(rel: str, paths: Sequence[str]) -> bool:
    """rel (a path under tests/) is one of `paths`, or under one ending in "/"."""
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in paths)


def work_unit(nodeid: str) -> str:
    """The unit of a test id (tests/<rel>::name): its file, or the tiny_cluster group."""
    rel = nodeid.split("::", 1)[0].removeprefix("tests/")
    return TINY_CLUSTER_UNIT if in_paths(rel, TINY_CLUSTER_PATHS) else rel


def longest_first(items: Sequence[ItemT]) -> list[ItemT]:
    """`items` with their units in order of expected seconds, longest first (ties: the order
    they came in); a unit's tests keep their order."""
    units = [work_unit(item.nodeid) for item in items]
    counts = Counter(units)  # in first-seen order; sorted() is stable, so ties keep it

    def expected(unit: str) -> float:
        return KNOWN_SECONDS.get(unit, counts[unit] * SECONDS_PER_TEST)

    rank = {unit: r for r, unit in enumerate(sorted(counts, key=expected, reverse=True))}
    return [item for _, item in sorted(zip(units, items, strict=True), key=lambda pair: rank[pair[0]])]
