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

    def stubs(self, *roles: str) -> list[StubWorker]:
        """Start several stubs at once (process start-up dominates test time)."""
        out = [StubWorker(role, wait=False) for role in roles]
        self.procs.extend(out)
        for w in out:
            w.wait_up()
        return out

    def router(self, args: list[str], *, wait: bool = True) -> RouterProc:
        r = RouterProc(self.model, args, wait=wait)
        self.procs.append(r)
        return r

    def pd(self, n_prefill: int = 1, n_decode: int = 1, *extra: str) -> tuple[RouterProc, list[StubWorker],
                                                                               list[StubWorker]]:
        """Stubs and router started together; returns once the router is ready."""
        ps = [StubWorker("prefill", wait=False) for _ in range(n_prefill)]
        ds = [StubWorker("decode", wait=False) for _ in range(n_decode)]
        self.procs.extend(ps + ds)
        r = self.router(pd_args(ps, ds, "--health-check-interval", "0.2", *extra), wait=False)
        for w in ps + ds:
            w.wait_up()
        r.wait_up()
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

