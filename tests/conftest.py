"""Shared fixtures: tiny random checkpoints (built once per session) and the real default model;
and the suite's tiers.

Tiers (markers, assigned here from each test's file so no test is left without one):
    unit         in-process, seconds: run first by launch/test.sh, which stops there on a failure
    proc         starts real processes (instances, routers, NIXL peers, pd.sh)
    reliability  kills, faults and load across a real cluster (tests/reliability)
    slow         marked in the test itself (the real default model); runs in its file's tier,
                 left out of the quick loop (-m "unit and not slow")

Stable names, used across test packages:
    tiny_checkpoint(arch, **overrides) -> str   factory, arch in llama | qwen2 | qwen3 | mistral;
                                       overrides of build_tiny_checkpoint (num_kv_heads=4, ...)
    tiny_llama_path, tiny_qwen2_path, tiny_qwen3_path, tiny_mistral_path -> str
    tiny_cluster -> tests.compat.cluster.Cluster   router + 1P1D + colocated on tiny llama, shared
    default_model_path -> str          SmolLM2-135M-Instruct converted into the user cache
                                       (converted once per machine, ~12 s the first time)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from common.model.testing import build_tiny_checkpoint
from tests.harness.process import START_COUNTS, reap_all

# One intra-op thread in this process and (through the environment) in every process a test
# starts. The suite runs several processes per core (xdist workers, instances, TP ranks); an
# OpenMP team of two waiting at its barriers for a descheduled partner made each tiny-model op
# take milliseconds (transformers' greedy reference ran 4x slower on a loaded box). Outputs are
# the same either way (GEMMs split rows, not the reduction). The `slow` real-model tests too:
# with two threads beside the other xdist worker they ran 3-6x slower, not faster.
TEST_THREADS = 1
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))
torch.set_num_threads(TEST_THREADS)
# Inductor's compile tests compile in their own process: its default pool of compile workers (one
# per core) starts processes that each import torch, while the box's other core runs the other
# xdist worker (a cold compile test: 83.6 -> 74.4 CPU-s, same kernels).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "proc", "reliability")
# Files whose tests start processes; everything else outside tests/reliability is `unit`.
PROC_PATHS = (
    "bench/test_engine_loops.py",
    "bench/test_gpu_bench_smoke.py",
    "bench/test_peer.py",
    "bench/test_serving_bench.py",
    "bench/test_soak.py",
    "compat/",
    "docs/test_doc_commands.py",
    "engine/test_tensor_parallel.py",
    "grammar/test_grammar_e2e.py",
    "grammar/test_grammar_real_model.py",
    "harness/",
    "k8s/test_chart_entrypoint.py",
    "k8s/test_discovery.py",
    "kv_transfer/test_bench_quick.py",
    "kv_transfer/test_kill.py",
    "kv_transfer/test_many_rooms.py",
    "launch/",
    "packaging/test_missing_package.py",
    "packaging/test_wheel.py",
    "pd/test_pd_aborts.py",
    "pd/test_pd_e2e.py",
    "pd/test_prefill_onednn_cache.py",
    "pd/test_pd_multiturn.py",
    "pd/test_pd_router_multiturn.py",
    "pd/test_pd_tp.py",
    "pd/test_pd_transfer_deadline.py",
    "pd/test_pd_transfer_health.py",
    "pd/test_pd_watchdog.py",
    "router/",
    "security/",
    "server/test_http_frontend.py",
    "server/test_instance_lifecycle.py",
    "server/test_liveness.py",
    "server/test_real_engine.py",
)


# Files whose tests use the session's `tiny_cluster`: one xdist work unit, so that one worker
# starts it (router + 1P1D + colocated) instead of each worker its own.
TINY_CLUSTER_PATHS = ("bench/test_soak.py", "compat/", "grammar/test_grammar_e2e.py",
                      "router/test_router_real.py")


def _in(rel: str, paths: tuple[str, ...]) -> bool:
    return any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in paths)


def tier_of(path: Path) -> str:
    rel = path.resolve().relative_to(TESTS).as_posix()
    if rel.startswith("reliability/"):
        return "reliability"
    if _in(rel, PROC_PATHS):
        return "proc"
    return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # One tier per test: a file that marks its own (pytestmark) keeps it, never runs in two.
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(getattr(pytest.mark, tier_of(Path(str(item.fspath)))))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """--dist loadfile, with the TINY_CLUSTER_PATHS files as one unit (see there)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedClusterScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tiny_cluster" if _in(path.removeprefix("tests/"), TINY_CLUSTER_PATHS) else path

    return SharedClusterScheduling(config, log)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reap_all()  # a process no fixture stopped (its test failed half-way) does not outlive the run


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Processes started, by kind (without xdist; launch/test.sh sums its workers' start logs)."""
    if START_COUNTS:
        terminalreporter.write_line("process starts: " + ", ".join(
            f"{k} {n}" for k, n in sorted(START_COUNTS.items(), key=lambda kv: -kv[1])))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """make(arch, **overrides): overrides go to build_tiny_checkpoint (e.g. num_kv_heads=4)."""
    built: dict[tuple[str, tuple[tuple[str, object], ...]], str] = {}

    def make(arch: str, **overrides: object) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in built:
            name = "-".join([f"tiny-{arch}", *(f"{k}{v}" for k, v in key[1])])
            built[key] = str(build_tiny_checkpoint(tmp_path_factory.mktemp(name), arch, **overrides))  # type: ignore[arg-type]
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama_path(tiny_checkpoint: Callable[[str], str]) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tiny_checkpoint: Callable[[str], str]) -> str:
    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_path(tiny_checkpoint: Callable[[str], str]) -> str:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def tiny_mistral_path(tiny_checkpoint: Callable[[str], str]) -> str:
    return tiny_checkpoint("mistral")


@pytest.fixture(scope="session")
def tiny_cluster(tiny_llama_path: str) -> Iterator[Any]:
    """1P1D behind a router plus a colocated instance, tiny llama, float32, default flags but a
    64k-token KV pool (tests/compat/cluster.py), shared by the modules that only send requests to it. Each such
    module keeps its requests to itself and checks the cluster whole when done."""
    from tests.compat.cluster import running_cluster

    with running_cluster(Path(tiny_llama_path)) as c:
        yield c


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from common.model.default_model import resolve_model_path

    return resolve_model_path(None)
