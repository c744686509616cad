"""Fixtures of the router tests: the tiny checkpoint and stub clusters (helpers in router_procs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.router.router_procs import Cluster, RouterProc, StubWorker


@pytest.fixture(scope="session")
def tiny_model(tiny_llama_path: str) -> Path:
    return Path(tiny_llama_path)


def _cluster(model: Path) -> Iterator[Cluster]:
    c = Cluster(model)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def cluster(tiny_model: Path) -> Iterator[Cluster]:
    yield from _cluster(tiny_model)


@pytest.fixture(scope="session")
def shared_pd(tiny_model: Path) -> Iterator[tuple[RouterProc, StubWorker, StubWorker]]:
    """One router over 1 prefill + 1 decode stub, shared by the read-only test modules."""
    for c in _cluster(tiny_model):
        r, ps, ds = c.pd(1, 1)
        yield r, ps[0], ds[0]

