"""The compat tests' shared cluster (tests/compat/cluster.py), one per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compat.cluster import Cluster, running_cluster


@pytest.fixture(scope="session")
def cluster(tiny_llama_path: str) -> Iterator[Cluster]:
    with running_cluster(Path(tiny_llama_path)) as c:
        yield c
