"""Real processes for router tests: stub workers and the router (127.0.0.1 only, always reaped)."""

from __future__ import annotations

import json
import os
import signal
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




class Proc:
    def __init__(self, argv: list[str], url: str, name: str, env: dict[str, str] | None = None,
                 preexec_fn: Any = None) -> None:
        self.url = url
        self.name = name
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        full_env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}", TOKENIZERS_PARALLELISM="false",
                        **(env or {}))
        self.popen = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=full_env, cwd=REPO,
                                      preexec_fn=preexec_fn)

    def wait_http(self, path: str, timeout: float = 60.0, status: int | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.output()}")
            try:
                r = httpx.get(self.url + path, timeout=1.0)
                if status is None or r.status_code == status:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: {path} not answering after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        if self.alive:
            self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=10)

    def stop(self) -> None:
        if self.alive:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=5)
        self.log.close()
        os.unlink(self.log.name)


class StubWorker(Proc):
    def __init__(self, role: str, port: int | None = None, *, wait: bool = True, **behavior: Any) -> None:
        self.role = role
        self.port = port or free_port()
        code = "import sys, stub_worker; stub_worker.main(sys.argv[1:])"
        argv = [sys.executable, "-c", code, "--port", str(self.port), "--role", role,
                "--behavior", json.dumps(behavior)]
        super().__init__(argv, f"http://127.0.0.1:{self.port}", f"stub-{role}-{self.port}")
        if wait:
            self.wait_up()

    def wait_up(self) -> None:
        self.wait_http("/stub/stats")

    def control(self, **behavior: Any) -> None:
        httpx.post(self.url + "/stub/control", json=behavior, timeout=5).raise_for_status()

    def stats(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/stub/stats", timeout=5)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def reset(self) -> None:
        httpx.post(self.url + "/stub/reset", timeout=5).raise_for_status()


ADMIN_KEY = "test-admin-key"  # every RouterProc has worker admin on, with this key
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


class RouterProc(Proc):
    def __init__(self, model_dir: str | Path, args: list[str], port: int | None = None, *, wait: bool = True,
                 admin_key: str | None = ADMIN_KEY, env: dict[str, str] | None = None, preexec_fn: Any = None
                 ) -> None:
        self.port = port or free_port()
        admin = ["--admin-api-key", admin_key] if admin_key else []
        argv = [sys.executable, "-m", "router", "--model-path", str(model_dir), "--port", str(self.port),
                "--log-level", "warning", *admin, *args]
        super().__init__(argv, f"http://127.0.0.1:{self.port}", f"router-{self.port}", env, preexec_fn)
        if wait:
            self.wait_up()

    def wait_up(self) -> None:
        self.wait_http("/metrics")

    def wait_ready(self, timeout: float = 20.0) -> None:
        self.wait_http("/health", timeout=timeout, status=200)

    def workers(self) -> dict[str, dict[str, Any]]:
        r = httpx.get(self.url + "/workers", timeout=5, headers=ADMIN)
        r.raise_for_status()
        return {w["url"]: w for w in r.json()["workers"]}


def pd_args(prefills: list[StubWorker], decodes: list[StubWorker], *extra: str) -> list[str]:
    args: list[str] = []
    for p in prefills:
        args += ["--prefill", p.url, str(p.port + 1)]
    for d in decodes:
        args += ["--decode", d.url]
    return [*args, *extra]
