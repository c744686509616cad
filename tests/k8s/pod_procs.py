"""Real pdserve instances standing in for pods: each on its own 127.0.0.x address, every pod on the
same HTTP port (as in a cluster, where --service-discovery-port is one number for all pods).

PodProcess(name, role, ip, port, model) starts `python -m prefill_server|decode_server --host ip`;
kill9() then start() again restarts it at the same address and ports (a container restart).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx

from tests.harness.process import ChildProcess, free_port

START_TIMEOUT_S = 120.0


class PodProcess:
    def __init__(self, name: str, role: str, ip: str, port: int, model_dir: str | Path, *extra: str) -> None:
        self.name = name
        self.role = role
        self.ip = ip
        self.port = port
        self.url = f"http://{ip}:{port}"
        self.bootstrap_port = free_port() if role == "prefill" else None
        argv = [sys.executable, "-m", f"{role}_server", "--model-path", str(model_dir), "--host", ip,
                "--port", str(port), "--device", "cpu", "--dtype", "float32", "--page-size", "4",
                "--max-total-tokens", "16384",
                "--log-level", os.environ.get("PDSERVE_TEST_LOG_LEVEL", "warning"), *extra]
        if self.bootstrap_port is not None:
            argv += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        self.child = ChildProcess(argv, f"pod_{name}", start=False)

    @property
    def labels(self) -> dict[str, str]:
        return {"app": "pdserve", "role": self.role}

    @property
    def annotations(self) -> dict[str, str]:
        return {"pdserve.io/bootstrap-port": str(self.bootstrap_port)} if self.bootstrap_port else {}

    def start(self) -> None:
        self.child.start()

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self) -> None:
        self.child.wait_for(self.healthy, START_TIMEOUT_S, "/health 200", period_s=0.2)

    def kill9(self) -> None:
        self.child.kill9()

    def stop(self) -> None:
        self.child.close()

    def log(self) -> str:
        return self.child.log()


__all__ = ["PodProcess", "free_port"]
