"""What bench/soak.py samples every --sample-interval: every process of every role (RSS, open
fds, threads, from /proc), each instance's engine gauges (its open /metrics: pool usage, queues)
and the router's per-worker state (GET /workers, admin key) and its DOWN transitions.

A role is a root pid (pd.sh's `pids` file, or given); its processes are the root and all its
descendants, keyed `role/comm` (`role/comm#2` for a second process of that name).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PAGE_MIB = resource.getpagesize() / 2**20
ENGINE_GAUGES = ("num_running_reqs", "num_waiting_reqs", "num_bootstrap_queue_reqs", "num_prealloc_queue_reqs",
                 "num_transfer_queue_reqs", "kv_pages_total", "kv_pages_free", "kv_pages_cached",
                 "kv_pages_in_use")


@dataclass(frozen=True)
class Role:
    name: str
    pid: int


@dataclass
class ProcSample:
    rss_mib: float
    fds: int
    threads: int


@dataclass
class Sample:
    t: float  # seconds since the soak started
    done: int  # requests finished (any outcome) at that time
    procs: dict[str, ProcSample] = field(default_factory=dict)
    engines: dict[str, dict[str, float]] = field(default_factory=dict)  # instance url -> gauges
    workers: list[dict[str, Any]] = field(default_factory=list)
    down_transitions: float = 0.0
    errors: list[str] = field(default_factory=list)


def read_pids_file(path: Path) -> list[Role]:
    """pd.sh's `NAME HOST PID LOG` lines (local roles only: their /proc is here)."""
    out = []
    for line in path.read_text().splitlines():
        name, host, pid, _ = line.split(" ", 3)
        if host in ("127.0.0.1", "localhost", "::1"):
            out.append(Role(name, int(pid)))
    return out


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry.name))
    return kids


def _proc(pid: int) -> tuple[str, ProcSample] | None:
    base = Path(f"/proc/{pid}")
    try:
        comm = (base / "comm").read_text().strip()
        rss = int((base / "statm").read_text().split()[1]) * PAGE_MIB
        threads = next(int(line.split()[1]) for line in (base / "status").read_text().splitlines()
                       if line.startswith("Threads:"))
        fds = len(os.listdir(base / "fd"))
    except (OSError, StopIteration, ValueError):
        return None
    return comm, ProcSample(round(rss, 1), fds, threads)


def sample_procs(roles: list[Role]) -> dict[str, ProcSample]:
    kids = _children()
    out: dict[str, ProcSample] = {}
    for role in roles:
        stack = [role.pid]
        while stack:
            pid = stack.pop()
            stack.extend(kids.get(pid, ()))
            got = _proc(pid)
            if got is None:
                continue
            comm, s = got
            key = f"{role.name}/{comm}"
            n = 2
            while key in out:
                key, n = f"{role.name}/{comm}#{n}", n + 1
            out[key] = s
    return out


def parse_gauges(text: str, names: tuple[str, ...] = ENGINE_GAUGES) -> dict[str, float]:
    want = {f"pdserve_{n}": n for n in names}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in want:
                out[want[s.name]] = s.value
    return out


def down_transitions(router_metrics: str) -> float:
    total = 0.0
    for fam in text_string_to_metric_families(router_metrics):
        for s in fam.samples:
            if s.name == "router_worker_health_transitions_total" and s.labels.get("to") == "down":
                total += s.value
    return total


class Sampler:
    """Owns nothing but an httpx client; `sample()` never raises (errors go into the Sample)."""

    def __init__(self, router_url: str, roles: list[Role], admin_key: str | None) -> None:
        self.router_url = router_url.rstrip("/")
        self.roles = roles
        self.http = httpx.AsyncClient(timeout=5.0)
        self.admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.instance_urls: list[str] = []

    async def aclose(self) -> None:
        await self.http.aclose()

    async def sample(self, t: float, done: int) -> Sample:
        s = Sample(round(t, 1), done, sample_procs(self.roles))
        try:
            r = await self.http.get(self.router_url + "/workers", headers=self.admin_headers)
            r.raise_for_status()
            s.workers = [{k: w.get(k) for k in ("url", "role", "healthy", "available", "breaker",
                                                 "in_flight_requests", "total_requests", "total_failures",
                                                 "last_error")} for w in r.json()["workers"]]
            self.instance_urls = [w["url"] for w in s.workers]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            s.errors.append(f"router /workers: {e}")
        try:
            s.down_transitions = down_transitions((await self.http.get(self.router_url + "/metrics")).text)
        except httpx.HTTPError as e:
            s.errors.append(f"router /metrics: {e}")
        for url in self.instance_urls:
            try:
                s.engines[url] = parse_gauges((await self.http.get(url + "/metrics")).text)
            except httpx.HTTPError as e:
                s.errors.append(f"{url}/metrics: {e}")
        return s


def pools_idle(engines: dict[str, dict[str, float]]) -> dict[str, str]:
    """Per instance: '' when it holds nothing (no request, every page free or cached), else why not."""
    out = {}
    for url, g in engines.items():
        busy = {k: g[k] for k in ENGINE_GAUGES[:5] if g.get(k)}
        in_use = g.get("kv_pages_in_use", 0.0)
        whole = g.get("kv_pages_free", 0.0) + g.get("kv_pages_cached", 0.0) == g.get("kv_pages_total", -1.0)
        out[url] = "" if not busy and in_use == 0 and whole else f"busy {busy}, in use {in_use}, whole {whole}"
    return out

