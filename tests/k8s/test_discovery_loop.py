"""The discovery loop in-process: a real Router (tiny model's tokenizer, no instances behind the pod
IPs: the workers stay unhealthy, which is not what these tests look at) against the fake Kubernetes
API over real HTTP. What the registry holds, and how each worker was found, for the states the
process tests do not reach: a command-line worker beside discovery, a new pod at an old pod's IP,
an event no watch delivered (repaired by the re-LIST), a failing LIST, pods that match both roles.
Plus the pure parts: selectors, pod -> worker, credentials, flags.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from router.app import Router
from router.config import RouterConfig, WorkerSpec
from router.discovery.kube_client import KubeApiError, KubeCredentials
from router.discovery.kube_types import ObjectMeta, Pod, PodCondition, PodStatus
from router.discovery.pod_match import PodMatcher
from router.discovery.service_discovery import ServiceDiscovery
from tests.k8s.fake_kube_api import FakeKubeApi, PodSpec

PREFILL = {"app": "pdserve", "role": "prefill"}
DECODE = {"app": "pdserve", "role": "decode"}
PORT = 31999  # nothing listens on 127.0.0.x:31999 here: probes are refused at once


@pytest.fixture(scope="module")
def api() -> Iterator[FakeKubeApi]:
    a = FakeKubeApi()
    a.start()
    yield a
    a.stop()


@pytest.fixture
def kubeconfig(api: FakeKubeApi, tmp_path: Path) -> Iterator[Path]:
    api.fail_lists(0)
    api.mute_watches(False)
    api.clear()
    yield api.kubeconfig(tmp_path / "kubeconfig")
    api.fail_lists(0)
    api.clear()


def router_cfg(model: str, kubeconfig: Path, *extra: str) -> RouterConfig:
    return RouterConfig.from_args([
        "--model-path", model, "--service-discovery", "--kubeconfig", str(kubeconfig),
        "--service-discovery-namespace", "serving", "--service-discovery-port", str(PORT),
        "--prefill-selector", "app=pdserve", "role=prefill", "--decode-selector", "app=pdserve", "role=decode",
        "--health-check-interval", "30", "--load-report-interval", "0", *extra])


@pytest.fixture
async def make_router(tiny_llama_path: str, kubeconfig: Path) -> AsyncIterator[Callable[..., Router]]:
    started: list[Router] = []

    def make(*extra: str) -> Router:
        r = Router(router_cfg(tiny_llama_path, kubeconfig, *extra))
        started.append(r)
        return r

    yield make
    for r in started:
        await r.stop()


def found(router: Router) -> dict[str, tuple[str, str, str | None]]:
    return {w.url: (w.role, w.source, w.pod) for w in router.registry.all()}


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def started(router: Router) -> ServiceDiscovery:
    """Start the router and wait for its first LIST: a pod put after it reaches the router only
    through its watch (kmock replays existing pods to a new watch), so seeing one proves the watch
    is open and a cut_watches() ends it."""
    await router.start()
    sd = router.discovery
    assert sd is not None
    await until(lambda: sd.lists >= 1, "first LIST")
    return sd


def url(ip: str) -> str:
    return f"http://{ip}:{PORT}"


async def test_command_line_workers_beside_discovery(api: FakeKubeApi, make_router: Callable[..., Router]) -> None:
    router = make_router("--decode", url("127.0.0.9"))
    await router.start()
    api.put_pod(PodSpec("decode-x", "127.0.0.9", DECODE))  # the command-line decode's address
    api.put_pod(PodSpec("prefill-0", "127.0.0.2", PREFILL, {"pdserve.io/bootstrap-port": "8998"}))
    api.put_pod(PodSpec("decode-0", "127.0.0.3", DECODE))
    await until(lambda: len(found(router)) == 3, f"3 workers: {found(router)}")  # decode-x's event came before
    assert router.discovery is not None and set(router.discovery.pods) == {"serving/prefill-0", "serving/decode-0"}
    assert found(router) == {
        url("127.0.0.9"): ("decode", "command-line", None),
        url("127.0.0.2"): ("prefill", "discovery", "serving/prefill-0"),
        url("127.0.0.3"): ("decode", "discovery", "serving/decode-0"),
    }
    assert router.registry.get(url("127.0.0.2")).bootstrap_port == 8998  # type: ignore[union-attr]
    api.delete_pod("decode-x")
    api.delete_pod("decode-0")
    await until(lambda: url("127.0.0.3") not in found(router), "decode-0 removed")
    assert found(router)[url("127.0.0.9")] == ("decode", "command-line", None)  # discovery never touches it


async def test_a_new_pod_at_an_old_pods_ip_is_a_new_worker(api: FakeKubeApi,
                                                          make_router: Callable[..., Router]) -> None:
    router = make_router()
    await router.start()
    api.put_pod(PodSpec("prefill-0", "127.0.0.2", PREFILL))
    await until(lambda: url("127.0.0.2") in found(router), "prefill-0")
    old = router.registry.get(url("127.0.0.2"))
    api.put_pod(PodSpec("prefill-1", "127.0.0.2", PREFILL))  # prefill-0's DELETED not seen (yet)
    await until(lambda: found(router).get(url("127.0.0.2"), ("", "", ""))[2] == "serving/prefill-1", "prefill-1")
    new = router.registry.get(url("127.0.0.2"))
    assert new is not old and old is not None and old.removed
    assert router.discovery is not None and set(router.discovery.pods) == {"serving/prefill-1"}
    api.delete_pod("prefill-0")  # the late event of the old pod does not remove the new one
    api.put_pod(PodSpec("decode-0", "127.0.0.3", DECODE))
    await until(lambda: url("127.0.0.3") in found(router), "decode-0 (after prefill-0's DELETED)")
    assert found(router)[url("127.0.0.2")] == ("prefill", "discovery", "serving/prefill-1")


async def test_an_event_no_watch_delivered_is_repaired_by_the_relist(
        api: FakeKubeApi, make_router: Callable[..., Router]) -> None:
    router = make_router("--service-discovery-resync", "1")
    sd = await started(router)
    api.put_pod(PodSpec("decode-0", "127.0.0.3", DECODE))
    await until(lambda: url("127.0.0.3") in found(router), "decode-0 (through the watch: it is open)")
    api.mute_watches()
    api.cut_watches("drop")
    watches = sd.watches
    await until(lambda: sd.watches > watches, "a new (muted) watch")
    lists = sd.lists
    api.set_ready("decode-0", "127.0.0.3", False)  # no watch tells the router
    await until(lambda: url("127.0.0.3") not in found(router), "removed by the re-LIST", 1.0 + 5.0)
    assert sd.lists > lists


async def test_a_failing_list_keeps_the_known_workers(api: FakeKubeApi, make_router: Callable[..., Router]) -> None:
    router = make_router()
    sd = await started(router)
    api.put_pod(PodSpec("decode-0", "127.0.0.3", DECODE))
    await until(lambda: url("127.0.0.3") in found(router), "decode-0 (through the watch: it is open)")
    lists = sd.lists
    api.fail_lists(2)
    api.cut_watches("410")
    await until(lambda: "HTTP 500" in (sd.last_error or ""), f"LIST failed: {sd.last_error}")
    assert url("127.0.0.3") in found(router)  # serving with what it knew
    await until(lambda: sd.lists > lists, "LIST again after the backoff (0.5 s, then 1 s)")
    api.put_pod(PodSpec("prefill-0", "127.0.0.2", PREFILL))
    await until(lambda: url("127.0.0.2") in found(router), "watching again")
    text = router.metrics.render().decode()
    assert 'router_discovery_restarts_total{reason="gone"} 1.0' in text
    assert 'router_discovery_restarts_total{reason="error"} 2.0' in text
    assert 'router_discovery_workers{role="decode"} 1.0' in text and 'router_discovery_workers{role="prefill"} 1.0' in text


def pod(labels: dict[str, str], *, ip: str | None = "10.0.0.5", phase: str = "Running", ready: str = "True",
        deleting: bool = False, annotations: dict[str, str] | None = None) -> Pod:
    return Pod(ObjectMeta(name="p", namespace="ns", labels=labels, annotations=annotations or {},
                          deletionTimestamp="2026-01-01T00:00:00Z" if deleting else None),
               PodStatus(phase=phase, podIP=ip, conditions=[PodCondition("Ready", ready)]))


def test_pod_matcher(tiny_llama_path: str, tmp_path: Path) -> None:
    m = PodMatcher.from_config(router_cfg(tiny_llama_path, tmp_path / "unused"))
    ann = {"pdserve.io/bootstrap-port": "9000"}
    assert m.common_label_selector == "app=pdserve"
    assert m.worker(pod({**PREFILL, "extra": "x"}, annotations=ann)) == WorkerSpec(
        f"http://10.0.0.5:{PORT}", "prefill", 9000, source="discovery", pod="ns/p")
    assert m.worker(pod(DECODE, ip="fd00::7")) == WorkerSpec(f"http://[fd00::7]:{PORT}", "decode", None,
                                                             source="discovery", pod="ns/p")
    assert m.worker(pod(PREFILL, annotations={"pdserve.io/bootstrap-port": "x"})).bootstrap_port is None  # type: ignore[union-attr]
    for not_a_worker in (pod({"app": "pdserve"}), pod({"app": "other", "role": "decode"}), pod(DECODE, ready="False"),
                         pod(DECODE, phase="Pending"), pod(DECODE, deleting=True), pod(DECODE, ip=None)):
        assert m.worker(not_a_worker) is None, not_a_worker
    both = PodMatcher.from_config(RouterConfig.from_args([
        "--model-path", tiny_llama_path, "--service-discovery", "--prefill-selector", "app=pdserve",
        "--decode-selector", "tier=gpu"]))
    assert both.common_label_selector == ""
    assert both.worker(pod({"app": "pdserve", "tier": "gpu"})) is None  # both roles: ignored


def test_discovery_flags(tiny_llama_path: str) -> None:
    base = ["--model-path", tiny_llama_path]
    cfg = RouterConfig.from_args([*base, "--service-discovery", "--selector", "app=pdserve", "tier=cpu"])
    assert not cfg.disaggregated and cfg.selector == (("app", "pdserve"), ("tier", "cpu"))
    assert RouterConfig.from_args([*base, "--service-discovery", "--selector", "a=b", "--worker", "http://w:1"]).worker
    assert cfg.service_discovery_port == 30000 and cfg.service_discovery_resync == 30.0
    for bad in (["--prefill-selector", "app=x", "--decode-selector", "app=y"],  # no --service-discovery
                ["--service-discovery", "--prefill-selector", "app=x"],  # no decode selector
                ["--service-discovery", "--prefill-selector", "app", "--decode-selector", "a=b"],  # not K=V
                ["--service-discovery", "--selector", "a=b", "--decode-selector", "a=c"],
                ["--service-discovery", "--worker", "http://w:1", "--prefill-selector", "a=b", "--decode-selector", "a=c"]):
        with pytest.raises(ValueError):
            RouterConfig.from_args([*base, *bad])


def test_kubeconfig_credentials(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok-1\n")
    ca = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    (tmp_path / "kc").write_text(
        "apiVersion: v1\ncurrent-context: b\n"
        "clusters:\n- name: ca\n  cluster: {server: 'https://k8s.example:6443/', "
        f"certificate-authority-data: {base64.b64encode(ca.encode()).decode()}}}\n"
        "- name: plain\n  cluster: {server: 'http://127.0.0.1:8001'}\n"
        "users:\n- name: u\n  user: {tokenFile: token}\n"
        "contexts:\n- name: a\n  context: {cluster: ca, user: u}\n- name: b\n  context: {cluster: plain}\n")
    b = KubeCredentials.from_kubeconfig(str(tmp_path / "kc"))
    assert (b.server, b.headers(), b.verify()) == ("http://127.0.0.1:8001", {}, True)
    a = KubeCredentials.from_kubeconfig(str(tmp_path / "kc"), context="a")
    assert a.server == "https://k8s.example:6443" and a.ca_data == ca and a.token_file == str(tmp_path / "token")
    assert a.headers() == {"Authorization": "Bearer tok-1"}
    (tmp_path / "token").write_text("tok-2")  # a rotated token is read again
    assert a.headers() == {"Authorization": "Bearer tok-2"}
    with pytest.raises(KubeApiError, match="no context"):
        KubeCredentials.from_kubeconfig(str(tmp_path / "kc"), context="missing")


def test_in_cluster_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeApiError, match="--kubeconfig"):
        KubeCredentials.in_cluster(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    (tmp_path / "token").write_text("sa-token")
    c = KubeCredentials.in_cluster(tmp_path)
    assert c.server == "https://[fd00::1]:443" and c.ca_file is None
    assert c.headers() == {"Authorization": "Bearer sa-token"}
