"""Soak: mixed traffic through launch/pd.sh for a long time, sampling every role (issue 41 item 7).

    python bench/soak.py --duration 1800 --rate 0.6 --max-concurrency 4 --output-file soak.json
    python bench/soak.py --base-url http://127.0.0.1:30000 --roles router=PID prefill-0=PID ...

Without --base-url it starts launch/pd.sh (--pd-args passed on, an admin key file of its own so
it can read the router's /workers) and stops it at the end. Requests (bench/soak_traffic.py)
arrive as a Poisson stream at --rate, at most --max-concurrency at a time, for --duration s; then
the soak waits for the cluster to go idle. Every --sample-interval s bench/soak_sampler.py
records each role process's RSS, fds and threads, each instance's pool gauges and the router's
per-worker state. Reported: requests ok/failed (every failure with its reason), RSS slope per
process in MiB per 1,000 requests after the first --slope-after, fds and threads ranges after
it, every pool whole at idle, DOWN transitions during the soak. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from soak_sampler import Role, Sample, Sampler, pools_idle, read_pids_file
from soak_traffic import Job, Outcome, TrafficClient, TrafficShape, draw_job

REPO = Path(__file__).resolve().parent.parent
READY_MARK = "pd.sh: READY"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", help="an already running router (then --roles names its processes)")
    p.add_argument("--roles", nargs="*", default=[], metavar="NAME=PID", help="with --base-url: root pid per role")
    p.add_argument("--admin-api-key-file", help="with --base-url: the router's admin key (for GET /workers)")
    p.add_argument("--pd-args", default="", help="extra launch/pd.sh flags (whitespace-split, shell quoting)")
    p.add_argument("--log-dir", default=None, help="pd.sh's log dir (default logs/soak-<time>)")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds of arrivals")
    p.add_argument("--min-requests", type=int, default=0,
                   help="keep arrivals going past --duration until this many requests were sent...")
    p.add_argument("--max-duration", type=float, default=4 * 3600.0, help="...but never past this many seconds")
    p.add_argument("--rate", type=float, default=0.6,
                   help="jobs per second (Poisson), an upper bound: a job waits for one of --max-concurrency")
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--sample-interval", type=float, default=10.0)
    p.add_argument("--slope-after", type=int, default=200, help="requests left out of the slopes and ranges")
    p.add_argument("--min-words", type=int, default=16)
    p.add_argument("--max-words", type=int, default=160)
    p.add_argument("--min-out", type=int, default=4)
    p.add_argument("--max-out", type=int, default=24)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--idle-timeout", type=float, default=120.0, help="seconds to wait for idle pools at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-file", help="JSON: result, every sample, every request outcome")
    return p.parse_args(argv)


class PdSh:
    """One launch/pd.sh run in its own session; stop() sends SIGTERM to pd.sh, which stops every role."""

    def __init__(self, log_dir: Path, pd_args: list[str], admin_key_file: Path) -> None:
        self.log_dir = log_dir
        self.out = log_dir.parent / f"{log_dir.name}.pd_sh.out"
        self.out_file = self.out.open("wb")
        self.proc = subprocess.Popen(["bash", str(REPO / "launch" / "pd.sh"), "--log-dir", str(log_dir),
                                      "--admin-api-key-file", str(admin_key_file), *pd_args], cwd=REPO,
                                     stdout=self.out_file, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout_s: float = 1200.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.out.read_text(errors="replace")
            if READY_MARK in text:
                return text
            if self.proc.poll() is not None:
                raise SystemExit(f"pd.sh exited {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(1.0)
        raise SystemExit(f"pd.sh not READY within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.out_file.close()


def router_port(pd_args: list[str]) -> int:
    return int(pd_args[pd_args.index("--port") + 1]) if "--port" in pd_args else 30000


def slope_per_1000(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of value over requests done, per 1,000 requests."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return 0.0 if den == 0 else sum((x - mx) * (y - my) for x, y in points) / den * 1000


class Soak:
    def __init__(self, args: argparse.Namespace, client: TrafficClient, sampler: Sampler, shape: TrafficShape):
        self.args = args
        self.client = client
        self.sampler = sampler
        self.shape = shape
        self.outcomes: list[Outcome] = []
        self.samples: list[Sample] = []
        self.t0 = time.monotonic()
        self.sent = 0

    async def _sample_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            s = await self.sampler.sample(time.monotonic() - self.t0, len(self.outcomes))
            self.samples.append(s)
            print(progress_line(s, self.outcomes), file=sys.stderr, flush=True)
            try:
                await asyncio.wait_for(stop.wait(), self.args.sample_interval)
            except TimeoutError:
                pass

    async def _job(self, sem: asyncio.Semaphore, job: Job) -> None:
        try:
            self.outcomes.extend(await self.client.run(job))
        finally:
            sem.release()

    async def run(self) -> None:
        a = self.args
        stop = asyncio.Event()
        sampler = asyncio.create_task(self._sample_loop(stop))
        sem = asyncio.Semaphore(a.max_concurrency)
        arrivals, jobs = random.Random(a.seed), random.Random(a.seed + 1)
        tasks: list[asyncio.Task[None]] = []
        self.t0 = time.monotonic()
        due = 0.0
        while (due < a.duration or self.sent < a.min_requests) and due < a.max_duration:
            delay = self.t0 + due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await sem.acquire()  # --rate is an upper bound: a full cluster delays the next arrival
            job = draw_job(jobs, len(tasks), self.shape)
            self.sent += len(job.prompts)
            tasks.append(asyncio.create_task(self._job(sem, job)))
            due += arrivals.expovariate(a.rate)
        await asyncio.gather(*tasks)
        deadline = time.monotonic() + a.idle_timeout
        while True:
            last = await self.sampler.sample(time.monotonic() - self.t0, len(self.outcomes))
            if not any(pools_idle(last.engines).values()) and last.engines or time.monotonic() > deadline:
                break
            await asyncio.sleep(1.0)
        stop.set()
        await sampler
        self.samples.append(last)

    def result(self) -> dict[str, Any]:
        a = self.args
        ok = [o for o in self.outcomes if o.ok]
        failed = [o for o in self.outcomes if not o.ok]
        after = [s for s in self.samples if s.done >= a.slope_after] or self.samples[-1:]
        keys = sorted({k for s in after for k in s.procs})

        def series(key: str, attr: str) -> list[float]:
            return [getattr(s.procs[key], attr) for s in after if key in s.procs]

        last = self.samples[-1]
        idle = pools_idle(last.engines)
        return {
            "requests": len(self.outcomes), "ok": len(ok), "failed": len(failed),
            "by_kind": {k: {"ok": sum(o.ok for o in self.outcomes if o.kind == k),
                            "failed": sum(not o.ok for o in self.outcomes if o.kind == k)}
                        for k in sorted({o.kind for o in self.outcomes})},
            "failures": dict(Counter(f"{o.kind}: {o.error[:160]}" for o in failed).most_common()),
            "duration_s": round(last.t, 1), "rate": a.rate, "max_concurrency": a.max_concurrency,
            "slope_after_requests": a.slope_after,
            "rss_mib_per_1000_requests": {k: round(slope_per_1000([(s.done, s.procs[k].rss_mib) for s in after
                                                                   if k in s.procs]), 2) for k in keys},
            "rss_mib_first_last": {k: [series(k, "rss_mib")[0], series(k, "rss_mib")[-1]] for k in keys},
            "fds_min_max": {k: [min(series(k, "fds")), max(series(k, "fds"))] for k in keys},
            "threads_min_max": {k: [min(series(k, "threads")), max(series(k, "threads"))] for k in keys},
            "pools_idle_ok": bool(idle) and not any(idle.values()), "pools_idle": idle,
            "down_transitions": last.down_transitions - self.samples[0].down_transitions,
            "workers_end": last.workers, "sample_errors": sum(len(s.errors) for s in self.samples),
            "samples": len(self.samples), "cpu": cpu_name(), "load_avg": round(os.getloadavg()[0], 2),
        }


def progress_line(s: Sample, outcomes: list[Outcome]) -> str:
    failed = sum(not o.ok for o in outcomes)
    rss = " ".join(f"{k}={p.rss_mib:.0f}" for k, p in s.procs.items() if p.rss_mib > 100)
    return f"[{s.t:7.0f}s] done {s.done} failed {failed} down {s.down_transitions:.0f} | RSS MiB {rss}"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


async def soak(args: argparse.Namespace, base_url: str, roles: list[Role], admin_key: str | None) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=30) as http:
        card = (await http.get(base_url.rstrip("/") + "/v1/models")).raise_for_status().json()["data"][0]
    shape = TrafficShape(args.min_words, args.max_words, args.min_out, args.max_out,
                         int(card.get("max_model_len") or 2048))
    client = TrafficClient(base_url, card["id"], args.request_timeout)
    sampler = Sampler(base_url, roles, admin_key)
    try:
        s = Soak(args, client, sampler, shape)
        await s.run()
        result = s.result()
    finally:
        await client.aclose()
        await sampler.aclose()
    if args.output_file:
        Path(args.output_file).write_text(json.dumps({
            "config": vars(args), "result": result,
            "samples": [{"t": x.t, "done": x.done, "procs": {k: vars(p) for k, p in x.procs.items()},
                         "engines": x.engines, "workers": x.workers, "down": x.down_transitions,
                         "errors": x.errors} for x in s.samples],
            "outcomes": [{k: v for k, v in vars(o).items() if k != "text"} for o in s.outcomes]}, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.rate > 0 and math.isfinite(args.rate)):
        raise SystemExit("--rate must be a positive number")
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally: stop pd.sh
    pd = None
    if args.base_url:
        roles = [Role(n, int(p)) for n, _, p in (r.partition("=") for r in args.roles)]
        key = Path(args.admin_api_key_file).read_text().strip() if args.admin_api_key_file else None
        base_url = args.base_url
    else:
        log_dir = Path(args.log_dir or f"logs/soak-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
        log_dir.parent.mkdir(parents=True, exist_ok=True)
        key = secrets.token_hex(16)
        key_file = log_dir.parent / f"{log_dir.name}.admin_key"
        key_file.touch(0o600)
        key_file.write_text(key)
        pd_args = shlex.split(args.pd_args)
        pd = PdSh(log_dir, pd_args, key_file)
        base_url = f"http://127.0.0.1:{router_port(pd_args)}"
    try:
        if pd is not None:
            pd.wait_ready()
            roles = read_pids_file(pd.log_dir / "pids")
        result = asyncio.run(soak(args, base_url, roles, key))
    finally:
        signal.signal(signal.SIGTERM, previous)
        if pd is not None:
            pd.stop()
            key_file.unlink(missing_ok=True)
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
