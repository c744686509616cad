"""The reliability cluster: 2 prefill + 2 decode real instances (tiny llama, fp32) and a router.

    p_slow  prefill, every KV post delayed 40 ms; while HOLD_FILE exists no transfer of it
            completes (holds requests in Transferring for as long as a case needs)
    p_fast  prefill, 16-token prefill steps (holds long prompts in computing)
    d_small decode, 640-token pool, 8 running max, optimistic admission (prealloc, retraction)
    d_big   decode, 16k-token pool
    router  round_robin over all four; health every 0.3 s

All instances run the overlap loop and use a 0.5 s heartbeat interval and a 2.5 s heartbeat timeout, so a dead or
stopped peer fails its requests within HEARTBEAT_BOUND_S. Scenarios that kill an instance
restart it on the same ports before they end (see `Cluster.revive`).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.harness.process import stop_all, wait_until
from tests.reliability.client import Job, run_jobs
from tests.reliability.procs import Instance, spawn_all, wait_whole
from tests.router.router_procs import RouterProc

HB_INTERVAL_S = 0.5
HB_TIMEOUT_S = 2.5
HEARTBEAT_BOUND_S = HB_TIMEOUT_S + HB_INTERVAL_S + 2.5  # + slack for a loaded 2-core box
DRAIN_TIMEOUT_S = 30.0  # kv_transfer TransferConfig.drain_timeout_s (no instance flag sets it)
BOOTSTRAP_TIMEOUT_S = 10.0
VOCAB = 384

HOLD_FILE = Path(tempfile.gettempdir()) / f"pdserve-rel-hold-{os.getpid()}"  # p_slow's stalled link
HB = ["--disaggregation-heartbeat-interval", str(HB_INTERVAL_S),
      "--disaggregation-heartbeat-timeout", str(HB_TIMEOUT_S)]
# The overlap loop (the default; named so the cases keep it): the matrix covers it, and its
# timing windows (a kill must catch requests in one state) were tuned on it.
PAGE = ["--page-size", "4", "--enable-cpu-overlap-schedule"]
PREFILL = [*PAGE, *HB, "--chunked-prefill-size", "16", "--max-total-tokens", "16384",
           "--disaggregation-bootstrap-timeout", str(BOOTSTRAP_TIMEOUT_S)]
DECODE = [*PAGE, *HB, "--disaggregation-transfer-timeout", "20"]
FLAGS = {
    "p_slow": ["--disaggregation-fault-spec", f"delay_ms=40,hold_file={HOLD_FILE}", *PREFILL],
    "p_fast": ["--max-prefill-tokens", "16", *PREFILL],
    "d_small": ["--max-total-tokens", "640", "--max-running-requests", "8", "--num-reserved-decode-tokens", "0",
                "--schedule-conservativeness", "0.1", *DECODE],
    "d_big": ["--max-total-tokens", "16384", *DECODE],
}


class Router:
    """The router process plus the few views of /workers the scenarios need."""

    def __init__(self, model_dir: Path, prefills: list[Instance], decodes: list[Instance], *extra: str) -> None:
        args: list[str] = ["--policy", "round_robin", "--health-check-interval", "0.3",
                           "--health-check-timeout", "1.5", "--breaker-open-seconds", "1", "--request-timeout", "60",
                           "--log-level", "warning", *extra]
        for p in prefills:
            args += ["--prefill", p.url, str(p.bootstrap_port)]
        for d in decodes:
            args += ["--decode", d.url]
        self.proc = RouterProc(model_dir, args, wait=False)
        self.url = self.proc.url

    def wait_ready(self) -> None:
        self.proc.wait_up()
        self.proc.wait_ready(timeout=60)

    def workers(self) -> dict[str, dict[str, Any]]:
        return self.proc.workers()

    def wait_worker(self, inst: Instance, *, healthy: bool, timeout_s: float) -> float:
        """Seconds until the router reports `inst` (un)healthy; AssertionError past timeout_s."""
        t0 = time.monotonic()
        ok = wait_until(lambda: self.workers()[inst.url]["healthy"] is healthy, timeout_s, period_s=0.1)
        assert ok, f"router still reports {inst.name} healthy={not healthy}: {self.workers()[inst.url]}"
        return time.monotonic() - t0

    def idle(self) -> bool:
        return all(w["in_flight_requests"] == 0 and w["in_flight_tokens"] == 0 for w in self.workers().values())

    def generate(self, client: httpx.Client, prompt: list[int], max_new: int) -> httpx.Response:
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                                         "ignore_eos": True}}
        return client.post(self.url + "/generate", json=body)

    def stop(self) -> None:
        self.proc.stop()


@dataclass
class Cluster:
    model_dir: Path
    p_slow: Instance
    p_fast: Instance
    d_small: Instance
    d_big: Instance
    router: Router
    drained_by: float = 0.0  # monotonic time by which every pending drain must have released its pages

    @property
    def instances(self) -> list[Instance]:
        return [self.p_slow, self.p_fast, self.d_small, self.d_big]

    def wait_whole(self, timeout_s: float = 20.0) -> None:
        """Every pool on every live instance whole at idle (past any pending drain deadline),
        and the router's load released."""
        wait_whole(self.instances, max(timeout_s, self.drained_by - time.monotonic()))
        assert wait_until(self.router.idle, 10.0), f"router load not released: {self.router.workers()}"

    def wait_whole_but_drains(self, timeout_s: float = 20.0, *, drain_from: float | None = None) -> None:
        """As wait_whole, except that decode pages held under the drain rule may stay held.

        drain_from: a fault at that time left decode pages to the drain rule (a dead or stopped
        prefill sends no drain ack, so they are held until the drain timeout). Every later
        wait_whole waits for them past that deadline: the scenarios that run meanwhile overlap
        the wait instead of sleeping through it."""
        if drain_from is not None:
            self.drained_by = max(self.drained_by, drain_from + DRAIN_TIMEOUT_S + 10.0)
        wait_whole(self.instances, timeout_s, allow_draining=True)
        assert wait_until(self.router.idle, 10.0), f"router load not released: {self.router.workers()}"

    def revive(self) -> None:
        """Restart whatever is dead (a scenario that failed half-way leaves the next one a whole cluster)."""
        dead = [i for i in self.instances if not (i.alive and i.healthy())]
        for inst in dead:
            inst.kill9()  # an engine that died leaves its frontend answering 503
            inst.restart()
        for inst in dead:
            inst.wait_healthy()
        for inst in dead:
            self.router.wait_worker(inst, healthy=True, timeout_s=20)
        if dead:
            self.warm_up()

    def warm_up(self) -> None:
        """One request per (prefill, decode) pair, so every decode has registered with every
        prefill: a scenario then starts with heartbeats flowing on every link (a prefill that
        dies during the first handshake is only noticed at the 10 s handshake timeout)."""
        jobs = [Job(p, d, [5, 6, 7, 8, 9], 1) for p in (self.p_slow, self.p_fast) for d in (self.d_small, self.d_big)]
        for o in run_jobs(jobs, timeout_s=30.0):
            assert o.ok, f"warm-up request failed: {o}"

    def stop(self) -> None:
        stop_all([self.router.proc.child, *(inst.child for inst in self.instances)])


def start_cluster(model_dir: Path) -> Cluster:
    roles = {"p": "prefill", "d": "decode"}
    insts = {name: Instance(name, roles[name[0]], model_dir, flags) for name, flags in FLAGS.items()}
    spawn_all(list(insts.values()))
    try:
        router = Router(model_dir, [insts["p_slow"], insts["p_fast"]], [insts["d_small"], insts["d_big"]])
    except BaseException:
        for inst in insts.values():
            inst.stop()
        raise
    cluster = Cluster(model_dir, router=router, **insts)
    try:
        router.wait_ready()
        cluster.warm_up()
    except BaseException:
        cluster.stop()
        raise
    return cluster
