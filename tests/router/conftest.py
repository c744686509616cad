"""Fixtures of the router tests: the tiny checkpoint and stub clusters (helpers in router_procs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.router.router_procs import Cluster, RouterProc, StubPool, StubWorker


@pytest.fixture(scope="session")
def tiny_model(tiny_llama_path: str) -> Path:
    return Path(tiny_llama_path)


def _cluster(model: Path, pool: StubPool | None = None) -> Iterator[Cluster]:
    c = Cluster(model, pool)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def stub_pool() -> Iterator[StubPool]:
    """Stub workers shared by the tests' clusters: each test gets them as started (restored)."""
    pool = StubPool()
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def cluster(tiny_model: Path, stub_pool: StubPool) -> Iterator[Cluster]:
    yield from _cluster(tiny_model, stub_pool)


@pytest.fixture(scope="session")
def shared_pd(tiny_model: Path) -> Iterator[tuple[RouterProc, StubWorker, StubWorker]]:
    """One router over 1 prefill + 1 decode stub, shared by the read-only test modules."""
    for c in _cluster(tiny_model):
        r, ps, ds = c.pd(1, 1)
        yield r, ps[0], ds[0]

