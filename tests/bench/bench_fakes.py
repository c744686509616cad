"""Helpers for bench tests: paths, a free port, the fake OpenAI server process.

Importing this module puts bench/ on sys.path (bench scripts import their siblings).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.harness.process import ChildProcess, free_port

__all__ = ["BENCH", "HERE", "REPO", "FakeServer", "free_port"]

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
        argv = [sys.executable, str(HERE / "fake_openai_server.py"), "--port", str(self.port),
                "--model-path", model_path]
        self.child = ChildProcess(argv, "fake_openai")
        try:
            self.child.wait_http(self.url + "/fake/stats", 30.0, period_s=0.05)
        except BaseException:
            self.stop()
            raise

    @property
    def popen(self) -> subprocess.Popen[bytes]:
        assert self.child.popen is not None
        return self.child.popen

    def control(self, **knobs: Any) -> None:
        httpx.post(self.url + "/fake/control", json=knobs, timeout=5).raise_for_status()

    def stats(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/fake/stats", timeout=5)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.child.stop(timeout_s=5.0)
        self.child.close()
