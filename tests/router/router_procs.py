"""Real processes for router tests: stub workers and the router (127.0.0.1 only, always reaped)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import httpx

from tests.harness.process import ChildProcess, free_port, stop_all

__all__ = ["ADMIN", "ADMIN_KEY", "Cluster", "Proc", "RouterProc", "StubPool", "StubWorker", "free_port", "pd_args"]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


class Proc:
    """A router or stub worker process (a tests/harness/process.py ChildProcess)."""

    def __init__(self, argv: list[str], url: str, name: str, env: dict[str, str] | None = None,
                 preexec_fn: Any = None) -> None:
        self.url = url
        self.name = name
        self.child = ChildProcess(argv, name, env={"TOKENIZERS_PARALLELISM": "false", **(env or {})},
                                  preexec_fn=preexec_fn)

    @property
    def popen(self) -> subprocess.Popen[bytes]:
        assert self.child.popen is not None
        return self.child.popen

    @property
    def log(self) -> IO[bytes]:
        return self.child.log_file

    def wait_http(self, path: str, timeout: float = 60.0, status: int | None = None) -> None:
        self.child.wait_http(self.url + path, timeout, status, period_s=0.05)

    def output(self) -> str:
        return self.child.log()

    @property
    def alive(self) -> bool:
        return self.child.alive

    def kill(self) -> None:
        self.child.kill9()

    def stop(self) -> None:
        self.child.stop(timeout_s=5.0)
        self.child.close()


class StubWorker(Proc):
    def __init__(self, role: str, port: int | None = None, *, wait: bool = True, **behavior: Any) -> None:
        self.role = role
        self.port = port or free_port()
        code = "import sys; from tests.router import stub_worker; stub_worker.main(sys.argv[1:])"
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

    def restore(self) -> bool:
        """Back to its start-up behavior with fresh stats; False if it no longer answers."""
        try:
            return self.alive and httpx.post(self.url + "/stub/restore", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False


class StubPool:
    """Idle stub workers kept across tests (a session fixture owns it and stops them at the end).

    A stub is a plain process with no state a test can see beyond its behavior and stats, which
    restore() puts back as at start-up; a stub a test killed (or that stopped answering) is
    stopped instead of pooled. Saves a process start (~1 s of CPU) per stub per test."""

    def __init__(self) -> None:
        self.idle: dict[str, list[StubWorker]] = {}
        self.started = 0

    def take(self, role: str) -> StubWorker:
        """An idle stub of `role`, or a new one (not waited for: call wait_up())."""
        if self.idle.get(role):
            return self.idle[role].pop()
        self.started += 1
        return StubWorker(role, wait=False)

    def put(self, stub: StubWorker) -> None:
        if stub.restore():
            self.idle.setdefault(stub.role, []).append(stub)
        else:
            stub.stop()

    def stop(self) -> None:
        stop_all([w.child for ws in self.idle.values() for w in ws], timeout_s=5.0)
        self.idle.clear()


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


class Cluster:
    """Stub workers + one router; everything started here is stopped by the fixture, except
    stubs from `pool`, which go back to it restored (stubs(); stub() with a behavior starts its own)."""

    def __init__(self, model: Path, pool: StubPool | None = None) -> None:
        self.model = model
        self.procs: list[Any] = []
        self.pool = pool
        self.pooled: list[StubWorker] = []

    def stub(self, role: str, **behavior: Any) -> StubWorker:
        w = StubWorker(role, **behavior)
        self.procs.append(w)
        return w

    def stubs(self, *roles: str) -> list[StubWorker]:
        """Start several stubs at once (process start-up dominates test time)."""
        if self.pool is not None:
            out = [self.pool.take(role) for role in roles]
            self.pooled.extend(out)
        else:
            out = [StubWorker(role, wait=False) for role in roles]
            self.procs.extend(out)
        for w in out:
            w.wait_up()
        return out

    def router(self, args: list[str], *, wait: bool = True) -> RouterProc:
        r = RouterProc(self.model, args, wait=wait)
        self.procs.append(r)
        return r

    def pd(self, n_prefill: int = 1, n_decode: int = 1, *extra: str) -> tuple[RouterProc, list[StubWorker],
                                                                               list[StubWorker]]:
        """Stubs and router started together; returns once the router is ready."""
        ps = [StubWorker("prefill", wait=False) for _ in range(n_prefill)]
        ds = [StubWorker("decode", wait=False) for _ in range(n_decode)]
        self.procs.extend(ps + ds)
        r = self.router(pd_args(ps, ds, "--health-check-interval", "0.2", *extra), wait=False)
        for w in ps + ds:
            w.wait_up()
        r.wait_up()
        r.wait_ready()
        return r, ps, ds

    def stop(self) -> None:
        """Routers and own stubs first (so no router still talks to a pooled stub), then the pooled stubs back."""
        stop_all([p.child for p in reversed(self.procs)], timeout_s=5.0)
        if self.pool is not None:
            for w in self.pooled:
                self.pool.put(w)
        self.pooled.clear()
