"""Helpers for bench tests: paths, a free port, the fake OpenAI server process.

Importing this module puts bench/ on sys.path (bench scripts import their siblings).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from tests.server.server_procs import free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BENCH = REPO / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))




class FakeServer:
    """tests/bench/fake_openai_server.py in a subprocess on 127.0.0.1."""

    def __init__(self, model_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        argv = [sys.executable, str(HERE / "fake_openai_server.py"), "--port", str(self.port),
                "--model-path", model_path]
        self.popen = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_ready(30.0)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"fake server exited: {self.log.read().decode(errors='replace')[-2000:]}")
            try:
                httpx.get(self.url + "/fake/stats", timeout=1.0).raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise TimeoutError(f"fake server on {self.url} not ready after {timeout}s")

    def control(self, **knobs: Any) -> None:
        httpx.post(self.url + "/fake/control", json=knobs, timeout=5).raise_for_status()

    def stats(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/fake/stats", timeout=5)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        self.log.close()
