"""Session fixtures of the reliability suite: one shared cluster (see cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.cluster import Cluster, start_cluster


@pytest.fixture(scope="session")
def cluster(tiny_llama_path: str) -> Iterator[Cluster]:
    c = start_cluster(Path(tiny_llama_path))
    try:
        yield c
        c.revive()
        c.wait_whole()  # the last scenario's pending drains released their pages too
    finally:
        c.stop()


@pytest.fixture
def whole_cluster(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster with every instance alive and whole before the test; revived after it."""
    cluster.revive()
    cluster.wait_whole_but_drains()  # pages may still wait for an earlier scenario's drain
    try:
        yield cluster
    finally:
        cluster.revive()
