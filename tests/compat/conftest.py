"""The compat tests' cluster: the session's shared tiny cluster (tests/compat/cluster.py), checked
whole after each module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.compat.cluster import Cluster


@pytest.fixture(scope="module")
def cluster(tiny_cluster: Cluster) -> Iterator[Cluster]:
    yield tiny_cluster
    tiny_cluster.wait_whole()
