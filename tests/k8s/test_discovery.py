"""Router service discovery against a fake Kubernetes API (kmock, real HTTP on 127.0.0.1) with REAL
pdserve instances on 127.0.0.2 (prefill) and 127.0.0.3 (decode) standing in as pod IPs.

One prefill, one decode and one router (`--service-discovery --kubeconfig ...`) per module; each
test starts from both pods Ready and routed to, changes pods through the API server's HTTP
endpoints, and ends with both instances' KV pools whole. The re-LIST interval is 600 s here, so
what the router does within a test comes from its WATCH (or a watch restart), never a resync.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.harness.process import LOAD_SLACK_S, stop_all, wait_until
from tests.k8s.fake_kube_api import FakeKubeApi, PodSpec
from tests.k8s.pod_procs import PodProcess, free_port
from tests.router.router_procs import ADMIN, RouterProc

HEALTH_INTERVAL_S = 0.3
SETTLE_S = 20.0  # a pod change -> the router's workers (a watch event, a probe, a pair round trip) on a loaded box


@dataclass
class Cluster:
    api: FakeKubeApi
    prefill: PodProcess
    decode: PodProcess
    router: RouterProc
    hold_file: Path  # while it exists, prefill's KV transfers do not complete: requests stay in flight

    def pod(self, inst: PodProcess, *, ready: bool = True) -> PodSpec:
        return PodSpec(inst.name, inst.ip, inst.labels, inst.annotations, ready)

    def state(self) -> dict[str, Any]:
        r = httpx.get(self.router.url + "/workers", headers=ADMIN, timeout=5)
        r.raise_for_status()
        return r.json()  # type: ignore[no-any-return]

    def workers(self) -> dict[str, dict[str, Any]]:
        return {w["url"]: w for w in self.state()["workers"]}

    def wait_workers(self, available: set[str], what: str) -> None:
        def match() -> bool:
            ws = self.workers()
            return set(ws) == available and all(w["available"] for w in ws.values())
        assert wait_until(match, SETTLE_S, period_s=0.1), f"{what}: workers {self.workers()}\n{self.router.output()}"

    def wait_discovery(self, pred: Any, what: str) -> dict[str, Any]:
        assert wait_until(lambda: pred(self.state()["service_discovery"]), SETTLE_S, period_s=0.1), (
            f"{what}: {self.state()['service_discovery']}\n{self.router.output()}")
        return self.state()["service_discovery"]  # type: ignore[no-any-return]

    def generate(self, max_new: int = 8) -> httpx.Response:
        body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": max_new, "temperature": 0,
                                                                          "ignore_eos": True}}
        return httpx.post(self.router.url + "/generate", json=body, timeout=60)

    def assert_serves(self, n: int = 1) -> None:
        for _ in range(n):
            r = self.generate()
            assert r.status_code == 200, f"{r.status_code} {r.text}\n{self.router.output()}"
            assert len(r.json()["output_ids"]) == 8

    def assert_refused(self) -> None:
        """No worker of a role: the request fails (bounded by --queue-timeout), it is not served."""
        t0 = time.monotonic()
        r = self.generate()
        assert r.status_code == 503, r.text
        assert time.monotonic() - t0 < 2.0 + LOAD_SLACK_S + 5.0


def pools_whole(inst: PodProcess) -> bool:
    text = httpx.get(inst.url + "/metrics", timeout=10).text
    stats = {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
             if ln.startswith("pdserve_") and "{" not in ln}
    free, cached, used = (stats.get(f"pdserve_kv_pages_{k}", -1) for k in ("free", "cached", "in_use"))
    return used == 0 and free + cached + used == stats.get("pdserve_kv_pages_total") \
        and stats.get("pdserve_num_running_reqs") == 0


@pytest.fixture(scope="module")
def cluster(tiny_llama_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    api = FakeKubeApi()
    api.start()
    port = free_port()  # every pod's HTTP port, as in a cluster
    hold_file = Path(tmp_path_factory.mktemp("hold")) / "hold"
    prefill = PodProcess("prefill-0", "prefill", "127.0.0.2", port, tiny_llama_path,
                         "--disaggregation-fault-spec", f"hold_file={hold_file}")
    decode = PodProcess("decode-0", "decode", "127.0.0.3", port, tiny_llama_path)
    procs = [prefill, decode]
    router = None
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_healthy()
        kubeconfig = api.kubeconfig(Path(tmp_path_factory.mktemp("k8s")) / "kubeconfig")
        router = RouterProc(tiny_llama_path, [
            "--service-discovery", "--kubeconfig", str(kubeconfig), "--service-discovery-namespace", "serving",
            "--prefill-selector", "app=pdserve", "role=prefill", "--decode-selector", "app=pdserve", "role=decode",
            "--service-discovery-port", str(port), "--service-discovery-resync", "600",
            "--health-check-interval", str(HEALTH_INTERVAL_S), "--health-check-timeout", "1.5",
            "--breaker-open-seconds", "1", "--queue-timeout", "2", "--request-timeout", "60"])
        yield Cluster(api, prefill, decode, router, hold_file)
    finally:
        stop_all([c.child for c in ([router] if router else [])] + [p.child for p in procs])
        api.stop()


@pytest.fixture(autouse=True)
def both_ready(cluster: Cluster) -> Iterator[None]:
    cluster.api.clear()
    for inst in (cluster.prefill, cluster.decode):
        if not inst.child.alive:
            inst.start()
            inst.wait_healthy()
        cluster.api.put_pod(cluster.pod(inst))
    cluster.wait_workers({cluster.prefill.url, cluster.decode.url}, "both pods Ready")
    cluster.router.wait_ready(SETTLE_S)
    yield
    for inst in (cluster.prefill, cluster.decode):
        if inst.child.alive:
            assert wait_until(lambda i=inst: pools_whole(i), 20.0, period_s=0.2), f"{inst.name} pools not whole"


def test_ready_pods_are_routed_and_others_ignored(cluster: Cluster) -> None:
    api = cluster.api
    api.put_pod(PodSpec("router-0", "127.0.0.4", {"app": "pdserve", "role": "router"}))
    api.put_pod(PodSpec("other-decode", "127.0.0.5", {"app": "other", "role": "decode"}))
    api.put_pod(PodSpec("decode-starting", "127.0.0.6", {"app": "pdserve", "role": "decode"}, ready=False))
    # a change after those three, so the router has seen them by the time it shows this one
    api.set_ready("decode-0", cluster.decode.ip, False)
    cluster.wait_workers({cluster.prefill.url}, "decode not ready")
    api.set_ready("decode-0", cluster.decode.ip, True)
    cluster.wait_workers({cluster.prefill.url, cluster.decode.url}, "decode ready again")

    ws = cluster.workers()
    p, d = ws[cluster.prefill.url], ws[cluster.decode.url]
    assert (p["role"], p["source"], p["pod"], p["bootstrap_port"]) == (
        "prefill", "discovery", "serving/prefill-0", cluster.prefill.bootstrap_port)
    assert (d["role"], d["source"], d["pod"]) == ("decode", "discovery", "serving/decode-0")
    assert set(cluster.state()["service_discovery"]["pods"]) == {"serving/prefill-0", "serving/decode-0"}
    before = (p["total_requests"], d["total_requests"])
    cluster.assert_serves(3)
    ws = cluster.workers()
    assert (ws[cluster.prefill.url]["total_requests"], ws[cluster.decode.url]["total_requests"]) == (
        before[0] + 3, before[1] + 3)


def stream(cluster: Cluster, max_new: int) -> list[dict[str, Any]]:
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", cluster.router.url + "/generate", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


def test_terminating_pod_gets_no_new_requests_and_its_stream_finishes(cluster: Cluster) -> None:
    cluster.hold_file.touch()  # the request below stays in flight on decode until the file goes
    try:
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(stream, cluster, 64)
            assert wait_until(lambda: cluster.workers()[cluster.decode.url]["in_flight_requests"] == 1, SETTLE_S)
            cluster.api.delete_pod("decode-0", finalizer=True)  # terminating: deletionTimestamp set, pod still there
            cluster.wait_workers({cluster.prefill.url}, "terminating decode removed")
            assert cluster.decode.child.alive and not pending.done()
            cluster.assert_refused()  # the only decode is draining: nothing new goes to it
            cluster.hold_file.unlink()
            events = pending.result(timeout=60)
    finally:
        cluster.hold_file.unlink(missing_ok=True)
    assert events and not any("error" in e for e in events), events[-1:]
    assert len(events[-1]["output_ids"]) == 64  # cumulative stream: the whole answer arrived
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    cluster.api.release("decode-0")
    cluster.wait_discovery(lambda sd: "serving/decode-0" not in sd["pods"], "pod gone")


def test_ready_false_and_back(cluster: Cluster) -> None:
    cluster.api.set_ready("decode-0", cluster.decode.ip, False)
    cluster.wait_workers({cluster.prefill.url}, "decode not ready")
    cluster.assert_refused()
    cluster.api.set_ready("decode-0", cluster.decode.ip, True)
    cluster.wait_workers({cluster.prefill.url, cluster.decode.url}, "decode ready again")
    cluster.router.wait_ready(SETTLE_S)
    cluster.assert_serves(2)


@pytest.mark.parametrize("cut", ["410", "drop"])
def test_watch_restarts_and_router_keeps_serving(cluster: Cluster, cut: str) -> None:
    watches = cluster.state()["service_discovery"]["watches"]
    cluster.api.cut_watches(cut)
    sd = cluster.wait_discovery(lambda sd: sd["watches"] > watches, f"watch restarted after {cut}")
    assert ("410 Gone" if cut == "410" else "watch ended") in sd["last_error"]
    cluster.assert_serves(2)  # with the workers it knew
    # the new watch sees changes (the re-LIST interval is 600 s: only the watch can tell)
    cluster.api.set_ready("prefill-0", cluster.prefill.ip, False)
    cluster.wait_workers({cluster.decode.url}, "prefill not ready (seen by the new watch)")
    cluster.api.set_ready("prefill-0", cluster.prefill.ip, True)
    cluster.wait_workers({cluster.prefill.url, cluster.decode.url}, "prefill back")
    cluster.assert_serves(1)


def test_prefill_restarted_at_the_same_ip(cluster: Cluster) -> None:
    """kill -9 the prefill, a new process at the same 127.0.0.2 address and ports (a new NIXL
    agent): decode must not use the old agent's metadata; requests succeed afterwards."""
    cluster.assert_serves(2)  # decode has met the old prefill's agent
    old = cluster.workers()[cluster.prefill.url]
    cluster.prefill.kill9()
    cluster.api.set_ready("prefill-0", cluster.prefill.ip, False)  # the kubelet's readiness probe fails
    cluster.wait_workers({cluster.decode.url}, "dead prefill removed")
    cluster.prefill.start()
    cluster.prefill.wait_healthy()
    cluster.api.set_ready("prefill-0", cluster.prefill.ip, True)
    cluster.wait_workers({cluster.prefill.url, cluster.decode.url}, "restarted prefill back")
    new = cluster.workers()[cluster.prefill.url]
    assert new["total_requests"] == 0 < old["total_requests"]  # a new registration, nothing carried over
    cluster.router.wait_ready(SETTLE_S)
    cluster.assert_serves(3)


def test_prefill_restarted_while_its_pod_stays_ready(cluster: Cluster) -> None:
    """The same restart faster than the kubelet's probe: the pod never leaves Ready, the router keeps
    the worker; after the restart requests succeed (decode drops the old agent's metadata)."""
    cluster.assert_serves(2)
    cluster.prefill.kill9()
    cluster.prefill.start()
    cluster.prefill.wait_healthy()
    cluster.wait_workers({cluster.prefill.url, cluster.decode.url}, "prefill healthy again")
    cluster.assert_serves(3)  # the first request after the restart too
