"""A colocated instance and a router in front of it, started by any command (`python -m ROLE` from
the checkout, or an installed console script), with the environment the test chooses: what the
packaging tests need to try an install as a user would. Always stop() it (a context manager)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.harness.process import REPO_ROOT, ChildProcess, free_port, stop_all

START_TIMEOUT_S = 180.0  # a tiny model on a loaded 2-core box: the engine's imports dominate

HIDE_XGRAMMAR = '''raise ModuleNotFoundError("No module named 'xgrammar' (hidden by tests/packaging)", name="xgrammar")\n'''


def hide_xgrammar(root: Path) -> Path:
    """A directory that, first on PYTHONPATH, makes `import xgrammar` fail as where it is not installed."""
    (root / "xgrammar").mkdir(parents=True, exist_ok=True)
    (root / "xgrammar" / "__init__.py").write_text(HIDE_XGRAMMAR)
    return root


@dataclass(frozen=True)
class Launch:
    """How to start a role: router / server map to the argv prefix that runs it."""

    router: list[str]
    server: list[str]
    cwd: Path = REPO_ROOT
    pythonpath: str | None = str(REPO_ROOT)  # None: inherit; the installed tests set their own
    env: dict[str, str] | None = None
    server_pythonpath: str | None = None  # the instance's, where it differs from the router's


@dataclass
class Serving:
    instance_url: str
    router_url: str
    children: list[ChildProcess]

    def post(self, base: str, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(base + path, json=body, timeout=120.0)

    def logs(self) -> str:
        return "\n".join(f"---- {c.name}\n{c.log()}" for c in self.children)


@contextmanager
def serving(launch: Launch, model: str) -> Iterator[Serving]:
    """Instance (cpu, float32) + router (--worker), both healthy, stopped on exit."""
    env = {"TOKENIZERS_PARALLELISM": "false", **(launch.env or {})}
    level = os.environ.get("PDSERVE_TEST_LOG_LEVEL", "warning")
    iport, rport = free_port(), free_port()
    instance = ChildProcess([*launch.server, "--model-path", model, "--port", str(iport), "--device", "cpu",
                             "--dtype", "float32", "--max-total-tokens", "8192", "--log-level", level],
                            "pkg-instance", env=env, cwd=launch.cwd,
                            pythonpath=launch.server_pythonpath or launch.pythonpath)
    children = [instance]
    try:
        router = ChildProcess([*launch.router, "--model-path", model, "--port", str(rport), "--log-level", level,
                               "--worker", f"http://127.0.0.1:{iport}"],
                              "pkg-router", env=env, cwd=launch.cwd, pythonpath=launch.pythonpath)
        children.append(router)
        s = Serving(f"http://127.0.0.1:{iport}", f"http://127.0.0.1:{rport}", children)
        instance.wait_http(s.instance_url + "/health", START_TIMEOUT_S, period_s=0.3)
        router.wait_http(s.router_url + "/health", START_TIMEOUT_S, period_s=0.3)
        yield s
    finally:
        stop_all(children)
