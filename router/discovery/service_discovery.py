"""Follow the cluster's pods: LIST, then WATCH, and keep the router's workers equal to the Ready pods.

    LIST -> reconcile (every matching Ready pod registered, every other discovered worker removed)
    WATCH from the LIST's resourceVersion, each event applied at once, until the resync deadline
    (--service-discovery-resync, 30 s): then LIST again, which repairs anything a watch missed.
    A watch that ends early, fails or answers 410 Gone: LIST + WATCH again after a backoff
    (0.5 s doubling to 30 s, reset by a watch that lasted); the router keeps serving with the
    workers it knows meanwhile.

Discovered workers go through the router's one registration path (Router.add_worker's parts):
registered at once, probed in a task, routable after their first good probe. A pod that turns
not-Ready, gets a deletionTimestamp (drain starts before the pod dies) or disappears is removed:
never picked again, its in-flight requests finish. A pod whose IP now belongs to a new pod (a
restart at the same IP) is a new Worker: nothing learned from the old process is kept. Workers
given on the command line or through POST /workers are never touched here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Protocol

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.config import RouterConfig, WorkerSpec
from router.discovery.kube_client import KubeApiError, KubeClient, KubeCredentials, WatchExpired
from router.discovery.kube_types import Pod
from router.discovery.pod_match import PodMatcher
from router.errors import ApiError
from router.worker import Worker

logger = logging.getLogger("router.discovery")
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
WATCH_GRACE_S = 5.0
LASTING_WATCH_S = 10.0  # a watch that lasted this long resets the backoff


class WorkerRegistrar(Protocol):
    """What discovery needs of the router (router.app.Router)."""

    def register(self, spec: WorkerSpec) -> Worker: ...

    async def verify_worker(self, w: Worker) -> None: ...

    def remove_worker(self, url: str) -> Worker: ...


class ServiceDiscovery:
    """Owns its KubeClient, its loop task and the map pod -> the worker it registered for it."""

    def __init__(self, client: KubeClient, matcher: PodMatcher, namespace: str | None, resync_s: float,
                 router: WorkerRegistrar) -> None:
        self.client = client
        self.matcher = matcher
        self.namespace = namespace
        self.resync_s = resync_s
        self.router = router
        self.pods: dict[str, WorkerSpec] = {}  # pod key (ns/name) -> the worker registered for it
        self.lists = 0  # completed LISTs
        self.watches = 0  # watches opened
        self.last_error: str | None = None
        self.restarts = {"gone": 0, "ended": 0, "error": 0}  # LIST + WATCH again, by why
        self._task: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[None]] = set()

    @classmethod
    def from_config(cls, cfg: RouterConfig, router: WorkerRegistrar) -> ServiceDiscovery:
        creds = KubeCredentials.from_kubeconfig(cfg.kubeconfig) if cfg.kubeconfig else KubeCredentials.in_cluster()
        return cls(KubeClient(creds), PodMatcher.from_config(cfg), cfg.service_discovery_namespace,
                   cfg.service_discovery_resync, router)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="service-discovery")

    async def stop(self) -> None:
        for t in [self._task, *self._checks]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._checks] if t is not None), return_exceptions=True)
        await self.client.close()

    async def _run(self) -> None:
        backoff = BACKOFF_INITIAL_S
        while True:
            started = time.monotonic()
            try:
                rv = await self.resync()
                await asyncio.wait_for(self._watch(rv), self.resync_s)
                kind, reason = "ended", "watch ended"
            except asyncio.TimeoutError:
                backoff = BACKOFF_INITIAL_S
                continue  # the resync deadline: LIST again at once
            except WatchExpired as e:
                kind, reason = "gone", str(e)
            except (KubeApiError, httpx.HTTPError, OSError) as e:
                kind, reason = "error", f"{type(e).__name__}: {e}"
            except Exception as e:  # a bug must not end discovery silently: log it, go on after the backoff
                logger.exception("service discovery: unexpected error")
                kind, reason = "error", f"{type(e).__name__}: {e}"
            self.restarts[kind] += 1
            self.last_error = reason
            if time.monotonic() - started > LASTING_WATCH_S:
                backoff = BACKOFF_INITIAL_S
            logger.warning("service discovery: %s; LIST + WATCH again in %.1f s (serving the %d discovered workers "
                           "known)", reason, backoff, len(self.pods))
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def resync(self) -> str:
        """One full LIST: register what is missing, remove what is gone. Returns the resourceVersion."""
        listing = await self.client.list_pods(self.namespace, self.matcher.common_label_selector)
        seen = set()
        for pod in listing.items:
            seen.add(pod.key)
            self.apply(pod)
        for key in [k for k in self.pods if k not in seen]:
            self._drop(key, "gone from the LIST")
        self.lists += 1
        return listing.metadata.resourceVersion

    async def _watch(self, rv: str) -> None:
        self.watches += 1
        # the server's own end comes after our resync deadline: an earlier end is a dropped watch
        async for kind, pod in self.client.watch_pods(self.namespace, rv, self.resync_s + WATCH_GRACE_S,
                                                     self.matcher.common_label_selector):
            if kind == "DELETED":
                if pod.key in self.pods:
                    self._drop(pod.key, "deleted")
            elif kind in ("ADDED", "MODIFIED"):
                self.apply(pod)

    def apply(self, pod: Pod) -> None:
        """Make the router's worker for this pod match the pod's state now."""
        key = pod.key
        want = self.matcher.worker(pod)
        have = self.pods.get(key)
        if have is not None and (want is None or _identity(have) != _identity(want)):
            why = "being deleted" if pod.metadata.deletionTimestamp else "not ready" if want is None else "changed"
            self._drop(key, why)
            have = None
        if want is None or have is not None:
            return
        for other, spec in list(self.pods.items()):
            if spec.url == want.url:  # a new pod at an old pod's IP: the old one is gone
                self._drop(other, f"its address now belongs to {key}")
        try:
            w = self.router.register(want)
        except ApiError as e:
            logger.warning("pod %s: not registered as %s worker %s: %s", key, want.role, want.url, e.message)
            return
        self.pods[key] = want
        logger.info("pod %s: %s worker %s registered", key, want.role, want.url)
        task = asyncio.get_running_loop().create_task(self.router.verify_worker(w))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    def _drop(self, key: str, why: str) -> None:
        spec = self.pods.pop(key)
        try:
            self.router.remove_worker(spec.url)
        except ApiError:
            return  # removed through DELETE /workers meanwhile
        logger.info("pod %s: %s worker %s removed (%s)", key, spec.role, spec.url, why)

    def describe(self) -> dict[str, object]:
        return {"namespace": self.namespace, "pods": {k: s.url for k, s in self.pods.items()},
                "lists": self.lists, "watches": self.watches, "restarts": dict(self.restarts),
                "last_error": self.last_error}

    def collector(self) -> Collector:
        """Prometheus view of this loop, for the router's registry (read at scrape time)."""
        return _DiscoveryCollector(self)


class _DiscoveryCollector(Collector):
    def __init__(self, sd: ServiceDiscovery) -> None:
        self.sd = sd

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        pods = GaugeMetricFamily("router_discovery_workers", "workers registered for pods, by role", labels=["role"])
        for role in sorted({s.role for s in self.sd.matcher.selectors}):
            pods.add_metric([role], sum(1 for s in self.sd.pods.values() if s.role == role))
        yield pods
        yield CounterMetricFamily("router_discovery_lists", "full LISTs of pods", value=self.sd.lists)
        yield CounterMetricFamily("router_discovery_watches", "WATCHes of pods opened", value=self.sd.watches)
        restarts = CounterMetricFamily("router_discovery_restarts", "LIST + WATCH again after a watch ended "
                                       "early, got 410 Gone, or failed", labels=["reason"])
        for kind, n in sorted(self.sd.restarts.items()):
            restarts.add_metric([kind], n)
        yield restarts


def _identity(spec: WorkerSpec) -> tuple[str, str, int | None]:
    return spec.url, spec.role, spec.bootstrap_port


__all__ = ["ServiceDiscovery", "WorkerRegistrar"]
