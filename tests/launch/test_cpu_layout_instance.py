"""One instance on CPU with --cpu-omp-threads-bind and --cpu-preload-libs (common/cpu_runtime.py):
its engine process runs confined, with the preload mapped in (the frontend without it), and
/server_info "cpu_runtime" says so, read from the live engine."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from common import cpu_runtime
from tests.launch.test_cpu_layout_pd import thread_cpus
from tests.server.server_procs import ServerProcess

ENGINE = "common.server.engine_process:engine_main"
GENERATE = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0.0,
                                                           "ignore_eos": True}}

Start = Callable[..., ServerProcess]


@pytest.fixture
def real_server(tiny_llama_path: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Start]:
    monkeypatch.setenv("PDSERVE_TEST_ENGINE", ENGINE)
    started: list[ServerProcess] = []

    def start(*extra: str) -> ServerProcess:
        server = ServerProcess(Path(tiny_llama_path), "--dtype", "float32", "--device", "cpu", *extra)
        started.append(server)
        server.wait_healthy(timeout_s=120)
        return server

    try:
        yield start
    finally:
        for s in started:
            s.stop()


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_bound_engine_with_a_preload_and_server_info(real_server: Start, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # a harmless real shared library under the preload's name: what is checked is the wiring
    # (found under PDSERVE_CPU_LIB_PATH, preloaded into the engine only, reported from /proc)
    libs = tmp_path / "libs"
    libs.mkdir()
    shutil.copy("/lib/x86_64-linux-gnu/libz.so.1", libs / "libjemalloc.so.2")
    monkeypatch.setenv(cpu_runtime.LIB_PATH_ENV, str(libs))
    server = real_server("--cpu-omp-threads-bind", "0", "--cpu-preload-libs", "jemalloc")
    info = server.server_info()
    engine = int(info["engine_pid"])
    assert info["cpu_runtime"] == {"allocator": "jemalloc", "openmp": "gomp", "cpus": [0], "threads": 1}
    assert str(libs / "libjemalloc.so.2") in _maps(engine)
    assert "libjemalloc" not in _maps(server.proc.pid)  # the frontend is untouched
    r = httpx.post(server.url + "/generate", json=GENERATE, timeout=120)
    assert r.status_code == 200, r.text
    threads = thread_cpus(engine)
    assert len(threads) > 1 and set(threads.values()) == {(0,)}, threads


def test_intel_openmp_preload_serves_the_same_tokens(real_server: Start) -> None:
    if cpu_runtime.find_lib("iomp5") is None:
        pytest.skip("intel-openmp (libiomp5.so) is not installed")
    outputs = {}
    for libs in ("none", "iomp5"):
        server = real_server("--cpu-preload-libs", libs)
        assert server.server_info()["cpu_runtime"]["openmp"] == ("gomp" if libs == "none" else "iomp5")
        r = httpx.post(server.url + "/generate", json=GENERATE, timeout=120)
        assert r.status_code == 200, r.text
        outputs[libs] = r.json()["output_ids"]
        server.stop()
    assert outputs["iomp5"] == outputs["none"] and len(outputs["none"]) == 6


def test_active_runtime_reads_the_live_process() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    env.pop("LD_PRELOAD", None)
    proc = subprocess.Popen(["taskset", "-c", "0", "sleep", "60"], env=env)
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/exe").resolve().name != "sleep":  # taskset has exec'd sleep
            assert time.monotonic() < deadline
            time.sleep(0.01)
        info = cpu_runtime.active_runtime(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert info == {"allocator": "glibc", "openmp": "none", "cpus": [0], "threads": 3}
