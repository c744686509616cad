"""tests/harness/work_units.py: the xdist work units of launch/test.sh, longest first."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.work_units import KNOWN_SECONDS, TINY_CLUSTER_UNIT, longest_first, work_unit

pytestmark = pytest.mark.unit  # in-process, though tests/harness/ is a proc path

TESTS = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Item:
    nodeid: str


def test_tiny_cluster_files_are_one_unit_and_other_files_their_own() -> None:
    assert work_unit("tests/compat/test_lm_eval.py::test_x") == TINY_CLUSTER_UNIT
    assert work_unit("tests/router/test_router_real.py::test_y[a]") == TINY_CLUSTER_UNIT
    assert work_unit("tests/router/test_router_faults.py::test_z") == "router/test_router_faults.py"


def test_units_come_longest_first_and_keep_their_tests_in_order() -> None:
    many = [Item(f"tests/cache/test_many.py::test_{i}") for i in range(200)]  # 200 x 0.3 s = 60 s
    items = [
        Item("tests/cache/test_few.py::test_a"),
        *many[:100],
        Item("tests/compat/test_lm_eval.py::test_one"),  # tiny_cluster: 120 s
        Item("tests/kv_transfer/test_bench_quick.py::test_one"),  # 24 s, one test
        *many[100:],
        Item("tests/cache/test_few.py::test_b"),
        Item("tests/bench/test_soak.py::test_two"),
    ]
    ordered = longest_first(items)
    assert sorted(ordered, key=lambda i: i.nodeid) == sorted(items, key=lambda i: i.nodeid)
    assert ordered[:2] == [items[101], items[-1]]  # the tiny_cluster unit, its tests in their order
    assert ordered[2:202] == many
    assert ordered[202:] == [items[102], items[0], items[-2]]  # 24 s, then 2 x 0.3 s


def test_every_known_unit_names_a_test_file() -> None:
    """A renamed or deleted file must not keep a stale entry (its new name would go last)."""
    stale = [u for u in KNOWN_SECONDS if u != TINY_CLUSTER_UNIT and not (TESTS / u).is_file()]
    assert not stale
