"""One real 1P1D cluster behind the router, and one colocated instance, on the tiny model (float32):
what the third-party clients of the compat tests and the router's PD-vs-colocated tests run
against (one per session and xdist worker: the `tiny_cluster` fixture in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.harness.process import stop_all
from tests.pd.pd_procs import PDPair, RoleProcess, start_pair, wait_until
from tests.router.router_procs import RouterProc

# 64k tokens of tiny-model KV (32 MiB) instead of the default 1 GiB pool: far above what any sharing
# module has in flight (context 1,024), without zeroing 1 GiB in each of the three instances.
POOL = ["--max-total-tokens", "65536"]


@dataclass
class Cluster:
    model: Path
    pair: PDPair
    router: RouterProc
    colocated: RoleProcess
    _colocated_router: RouterProc | None = None

    def colocated_router(self) -> RouterProc:
        """A router in front of the colocated instance, started on first use, stopped with the cluster."""
        if self._colocated_router is None:
            self._colocated_router = RouterProc(self.model, ["--worker", self.colocated.url])
            self._colocated_router.wait_ready(timeout=60)
        return self._colocated_router

    def wait_whole(self) -> None:
        """Every instance idle with all its KV pages back (a sharing module checks this when done)."""
        self.pair.wait_whole()
        assert wait_until(lambda: self.colocated.stat("kv_pages_in_use") == 0
                          and self.colocated.stat("num_running_reqs") == 0, 20.0, period_s=0.2), \
            self.colocated.log()[-2000:]


@contextmanager
def running_cluster(model: Path) -> Iterator[Cluster]:
    """Starts the instances together, yields once the router is ready; stops everything after."""
    colocated = RoleProcess("common.server", model, "--dtype", "float32", *POOL)
    pair = None
    router = None
    cluster = None
    try:
        pair = start_pair(model, POOL, POOL)
        colocated.wait_healthy()
        router = RouterProc(model, ["--prefill", pair.prefill.url, str(pair.prefill.bootstrap_port),
                                    "--decode", pair.decode.url])
        router.wait_ready(timeout=60)
        cluster = Cluster(model, pair, router, colocated)
        yield cluster
    finally:
        extra = cluster._colocated_router if cluster is not None else None
        procs = [extra, router, *((pair.prefill, pair.decode) if pair is not None else ()), colocated]
        stop_all([p.child for p in procs if p is not None])
