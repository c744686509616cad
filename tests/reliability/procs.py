"""Real instances on fixed ports (kill -9, SIGSTOP/SIGCONT, restart on the same ports) and the
pool checks every reliability scenario ends with.

Instance owns one `python -m prefill_server|decode_server` process group at a time (a
tests/harness/process.py ChildProcess); every process it starts is reaped by `stop()` (the
fixtures call it in a finally). Logs go to a temp file per instance, removed at stop unless
PDSERVE_TEST_KEEP_LOGS is set; the log level comes from PDSERVE_TEST_LOG_LEVEL (default warning).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.harness.process import REPO_ROOT, ChildProcess, free_port, stop_all, wait_until

__all__ = ["REPO_ROOT", "START_TIMEOUT_S", "IDLE_ZERO", "Instance", "spawn_all", "wait_whole"]

START_TIMEOUT_S = 120.0

# Gauges that must read 0 on an idle instance, per role.
IDLE_ZERO = {
    "common": ("kv_pages_in_use", "num_running_reqs", "num_waiting_reqs", "num_chunked_reqs",
               "frontend_in_flight_requests"),
    "prefill": ("num_bootstrap_queue_reqs", "num_inflight_queue_reqs"),
    "decode": ("num_prealloc_queue_reqs", "num_transfer_queue_reqs", "num_draining_reqs", "num_retracted_reqs"),
}


class Instance:
    """One PD instance; `role` is "prefill" or "decode". Ports are chosen once and kept across restarts."""

    def __init__(self, name: str, role: str, model_dir: Path, flags: list[str]) -> None:
        self.name = name
        self.role = role
        self.model_dir = model_dir
        self.flags = flags
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bootstrap_port = free_port() if role == "prefill" else None
        self.restarts = 0
        argv = [sys.executable, "-m", f"{self.role}_server", "--model-path", str(self.model_dir),
                "--port", str(self.port), "--device", "cpu", "--dtype", "float32",
                "--log-level", os.environ.get("PDSERVE_TEST_LOG_LEVEL", "warning"),
                "--incremental-streaming-output", *self.flags]  # delta streams (the default is cumulative)
        if self.bootstrap_port is not None:
            argv += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        self.child = ChildProcess(argv, f"rel_{name}", start=False)

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.child.popen

    # ---- lifecycle ------------------------------------------------------------------------------
    def spawn(self) -> None:
        """Start the process group (does not wait); the previous one must be gone."""
        self.child.start()

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.child.wait_for(self.healthy, timeout_s, "/health 200", period_s=0.2)

    def restart(self) -> None:
        """Spawn again on the same ports (after kill9); returns at once, see wait_healthy."""
        self.restarts += 1
        self.spawn()

    @property
    def alive(self) -> bool:
        return self.child.alive

    def kill9(self) -> None:
        """kill -9 the whole instance (frontend and engine)."""
        self.child.kill9()

    def sigstop(self) -> None:
        self.child.signal_group(signal.SIGSTOP)

    def sigcont(self) -> None:
        self.child.signal_group(signal.SIGCONT)

    def stop(self) -> None:
        self.child.close()

    def log(self, tail: int = 3000) -> str:
        return self.child.log(tail)

    # ---- observation ----------------------------------------------------------------------------
    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stats(self) -> dict[str, float]:
        """Every unlabeled pdserve_* sample of /metrics, from a fresh engine answer (retried)."""
        for _ in range(20):
            text = httpx.get(self.url + "/metrics", timeout=10.0).text
            out: dict[str, float] = {}
            for line in text.splitlines():
                if line.startswith("pdserve_") and "{" not in line:
                    key, value = line.split()
                    out[key.removeprefix("pdserve_")] = float(value)
            if out.get("engine_up") == 1.0:
                return out
            time.sleep(0.1)
        raise AssertionError(f"{self.name}: engine did not answer a stats probe")

    def busy_gauges(self, *, allow_draining: bool = False) -> dict[str, float]:
        """The idle-zero gauges that are not zero (empty dict: the instance is whole at idle).
        allow_draining: pages held by failed transfers awaiting their drain do not count."""
        s = self.stats()
        names = IDLE_ZERO["common"] + IDLE_ZERO[self.role]
        if allow_draining and s.get("num_draining_reqs", 0) > 0:
            names = tuple(n for n in names if n not in ("num_draining_reqs", "kv_pages_in_use"))
        bad = {n: s.get(n, -1.0) for n in names if s.get(n, -1.0) != 0.0}
        pages = s.get("kv_pages_free", 0) + s.get("kv_pages_cached", 0) + s.get("kv_pages_in_use", 0)
        if pages != s.get("kv_pages_total"):
            bad["kv_pages_free+cached+in_use-total"] = pages - s.get("kv_pages_total", 0)
        return bad


def wait_whole(instances: list[Instance], timeout_s: float = 20.0, *, allow_draining: bool = False) -> None:
    """Every live instance idle with every pool whole; fails naming the gauges that are not."""
    live = [i for i in instances if i.alive]
    last: dict[str, dict[str, float]] = {}

    def whole() -> bool:
        last.clear()
        for inst in live:
            bad = inst.busy_gauges(allow_draining=allow_draining)
            if bad:
                last[inst.name] = bad
        return not last

    if not wait_until(whole, timeout_s, period_s=0.25):
        logs = "\n".join(f"--- {i.name}:\n{i.log(1500)}" for i in live if i.name in last)
        raise AssertionError(f"pools not whole after {timeout_s}s: {last}\n{logs}")


def spawn_all(instances: list[Instance]) -> None:
    """Start several instances at once (start-up dominates) and wait for all; stops them on failure."""
    try:
        for inst in instances:
            inst.spawn()
        for inst in instances:
            inst.wait_healthy()
    except BaseException:
        stop_all([inst.child for inst in instances])
        raise
