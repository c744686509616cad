"""Real instance processes for frontend tests.

`ServerProcess` runs `python -c "...fake_engine.serve(argv)"` (the real launcher,
frontend and ZMQ IPC with the fake engine), waits for /health, and always stops
it (SIGTERM, then SIGKILL). To run the same HTTP tests against another engine,
set PDSERVE_TEST_ENGINE to a `module:function` engine main.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0


# Below the kernel's ephemeral range (32768-60999 here): a port picked there could be taken by
# some outbound connection between this check and the server's bind, or its re-bind after a
# restart on the same port (seen in the reliability suite).
_PORT_RANGE = (20000, 32000)


_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, outside the ephemeral range, and never handed
    out before in this test process (two servers started back to back once drew the same
    random port: both were told to bind it before either did)."""
    low, high = _PORT_RANGE
    start = random.randrange(high - low)
    for i in range(high - low):
        port = low + (start + i) % (high - low)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free port found")


def _launcher_code() -> str:
    target = os.environ.get("PDSERVE_TEST_ENGINE")
    if not target:
        return "import sys; from tests.server.fake_engine import serve; serve(sys.argv[1:])"
    module, func = target.split(":")
    return (
        f"import sys; from common.server.launch import main; from {module} import {func} as m; "
        "main(sys.argv[1:], engine_main=m)"
    )


class ServerProcess:
    """One instance (frontend + engine) in a child process group of the test."""

    def __init__(self, model_dir: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile(prefix="pdserve_srv_", suffix=".log", delete=False)
        argv = [
            "--model-path",
            str(model_dir),
            "--port",
            str(self.port),
            "--log-level",
            os.environ.get("PDSERVE_TEST_LOG_LEVEL", "warning"),
            "--incremental-streaming-output",  # these tests read delta streams (the default is cumulative)
            *extra,
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _launcher_code(), *argv],
            cwd=REPO_ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy within {timeout_s}s:\n{self.log()}")

    def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = httpx.get(self.url + "/server_info", timeout=5.0).json()
        return info

    def engine_pid(self) -> int:
        return int(self.server_info()["pools"]["pid"])

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)
        return self.proc.returncode


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_until(cond: Callable[[], bool], timeout_s: float, period_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(period_s)
    return cond()
