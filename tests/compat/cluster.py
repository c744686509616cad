"""One real 1P1D cluster behind the router, and one colocated instance, on the tiny model (float32):
what the third-party clients of the compat tests run against (the fixture is in conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.harness.process import stop_all
from tests.pd.pd_procs import PDPair, RoleProcess, start_pair
from tests.router.router_procs import RouterProc


@dataclass
class Cluster:
    model: Path
    pair: PDPair
    router: RouterProc
    colocated: RoleProcess


@contextmanager
def running_cluster(model: Path) -> Iterator[Cluster]:
    """Starts the instances together, yields once the router is ready; stops everything after."""
    colocated = RoleProcess("common.server", model, "--dtype", "float32")
    pair = None
    router = None
    try:
        pair = start_pair(model, [], [])
        colocated.wait_healthy()
        router = RouterProc(model, ["--prefill", pair.prefill.url, str(pair.prefill.bootstrap_port),
                                    "--decode", pair.decode.url])
        router.wait_ready(timeout=60)
        yield Cluster(model, pair, router, colocated)
    finally:
        procs = [router, *((pair.prefill, pair.decode) if pair is not None else ()), colocated]
        stop_all([p.child for p in procs if p is not None])
