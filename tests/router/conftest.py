from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from router_procs import RouterProc, StubWorker, pd_args

from common.model.testing import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("router-model") / "tiny", "llama")


class Cluster:
    """Stub workers + one router; everything started here is stopped by the fixture."""

    def __init__(self, model: Path) -> None:
        self.model = model
        self.procs: list[Any] = []

    def stub(self, role: str, **behavior: Any) -> StubWorker:
        w = StubWorker(role, **behavior)
        self.procs.append(w)
        return w

    def router(self, args: list[str]) -> RouterProc:
        r = RouterProc(self.model, args)
        self.procs.append(r)
        return r

    def pd(self, n_prefill: int = 1, n_decode: int = 1, *extra: str, ready: bool = True
           ) -> tuple[RouterProc, list[StubWorker], list[StubWorker]]:
        ps = [self.stub("prefill") for _ in range(n_prefill)]
        ds = [self.stub("decode") for _ in range(n_decode)]
        r = self.router(pd_args(ps, ds, "--health-check-interval", "0.2", *extra))
        if ready:
            r.wait_ready()
        return r, ps, ds

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


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

