"""Real instance processes for frontend tests.

`ServerProcess` runs `python -c "...fake_engine.serve(argv)"` (the real launcher,
frontend and ZMQ IPC with the fake engine), waits for /health, and always stops
it (SIGTERM, then SIGKILL). To run the same HTTP tests against another engine,
set PDSERVE_TEST_ENGINE to a `module:function` engine main.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.harness.process import REPO_ROOT, ChildProcess, free_port, pid_alive, wait_until

__all__ = ["REPO_ROOT", "START_TIMEOUT_S", "ServerProcess", "free_port", "pid_alive", "wait_until"]

START_TIMEOUT_S = 60.0


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
        self.child = ChildProcess([sys.executable, "-c", _launcher_code(), *argv], "srv")

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self.child.popen is not None
        return self.child.popen

    def log(self) -> str:
        return self.child.log(tail=None)

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.child.wait_http(self.url + "/health", timeout_s, period_s=0.2)

    def server_info(self) -> dict[str, Any]:
        info: dict[str, Any] = httpx.get(self.url + "/server_info", timeout=5.0).json()
        return info

    def engine_pid(self) -> int:
        return int(self.server_info()["pools"]["pid"])

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM; the engine must exit with its frontend by itself (tests check it), so only
        a frontend that ignores SIGTERM for timeout_s gets its group killed here."""
        returncode = self.child.stop(timeout_s, leftovers=False)
        self.child.log_file.close()
        if not self.child.keep_log:
            Path(self.child.log_file.name).unlink(missing_ok=True)
        assert returncode is not None
        return returncode
