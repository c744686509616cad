"""One real 1P1D cluster behind the router, and one colocated instance, on the tiny model (float32),
shared by the tests that run third-party clients against them."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.pd.pd_procs import PDPair, RoleProcess, start_pair
from tests.router.router_procs import RouterProc


@dataclass
class Cluster:
    model: Path
    pair: PDPair
    router: RouterProc
    colocated: RoleProcess


@pytest.fixture(scope="session")
def cluster(tiny_llama_path: str) -> Iterator[Cluster]:
    model = Path(tiny_llama_path)
    colocated = RoleProcess("common.server", model, "--dtype", "float32")
    pair = start_pair(model, [], [])
    router = None
    try:
        colocated.wait_healthy()
        router = RouterProc(model, ["--prefill", pair.prefill.url, str(pair.prefill.bootstrap_port),
                                    "--decode", pair.decode.url])
        router.wait_ready(timeout=60)
        yield Cluster(model, pair, router, colocated)
    finally:
        if router is not None:
            router.stop()
        pair.stop()
        colocated.stop()
