"""A fake Kubernetes API server speaking real HTTP: kmock's KubernetesEmulator on 127.0.0.1, in a thread.

    api = FakeKubeApi(); api.start()          LIST/WATCH/CREATE/PATCH/DELETE of pods over HTTP
    api.put_pod(PodSpec(...))                 create (ADDED) or patch (MODIFIED) a pod
    api.set_ready(name, False)                flip its Ready condition
    api.delete_pod(name, finalizer=True)      with a finalizer: deletionTimestamp only (MODIFIED)
    api.cut_watches("410" | "drop")           end every open WATCH: an ERROR 410 Gone event, or EOF (a
                                              watch that delivered an event is open: tests wait for one)
    api.mute_watches() / api.fail_lists(n)    new watches deliver no event / the next n LISTs answer 500
    api.kubeconfig(path)                      a kubeconfig pointing at it (what --kubeconfig reads)

The test drives pods through the API server's own HTTP endpoints (as a kubelet or controller
would), so the router sees exactly what a real server would send it. The emulator ignores
labelSelector: the router must match labels itself.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import kmock
from kmock._internal import rendering

NAMESPACE = "serving"


class _Emulator(kmock.KubernetesEmulator):  # type: ignore[misc]
    """The emulator, whose open watches a test can end (a dropped connection, a 410 Gone)."""

    cut: asyncio.Event | None = None
    cut_kind: str = "drop"
    muted: bool = False  # open watches deliver nothing (events a watch missed)
    failing_lists: int = 0  # this many LISTs answer 500

    async def _serve_list(self, request: rendering.Request) -> Any:
        if self.failing_lists > 0:
            self.failing_lists -= 1
            raise kmock.KubernetesError(status=500, reason="InternalError", message="etcdserver: request timed out")
        return await super()._serve_list(request)

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[Any]:
        """As the emulator's watch, but subscribed to the event bus BEFORE the snapshot of existing pods
        (the emulator subscribes after sending it, and loses what changes meanwhile: a real API server
        resumes from the LIST's resourceVersion and loses nothing)."""
        cut = self.cut  # a cut_watches() from now on ends this watch
        assert cut is not None and request.resource is not None
        bus = self._buses[request.resource]
        marker = await bus.mark()
        try:
            yield b""  # the headers go out now: the client sees its watch open
            if not self.muted:
                for item in await self._snapshot(request):
                    yield item
            events = bus.stream(since=marker).__aiter__()
            stop = asyncio.ensure_future(cut.wait())
            nxt: asyncio.Future[Any] | None = None
            try:
                while True:
                    nxt = asyncio.ensure_future(events.__anext__())
                    await asyncio.wait({nxt, stop}, return_when=asyncio.FIRST_COMPLETED)
                    if not nxt.done():
                        break
                    event = nxt.result()
                    meta = event.get("object", {}).get("metadata", {})
                    if not self.muted and meta.get("namespace") == request.namespace:
                        yield event
            finally:
                for f in (nxt, stop):
                    if f is not None:
                        f.cancel()
            if self.cut_kind == "410":
                yield self.gone()
        finally:
            await bus.unmark(marker)

    async def _snapshot(self, request: rendering.Request) -> list[dict[str, Any]]:
        async with self._lock:
            objs = [o for (res, ns, _), o in self.objects.items()
                    if res == request.resource and ns == request.namespace and not o.deleted]
            return [{"type": "ADDED", "object": o.raw} for o in objs]

    @staticmethod
    def gone() -> dict[str, Any]:
        return {"type": "ERROR", "object": {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                                            "reason": "Expired", "message": "too old resource version"}}


@dataclass
class PodSpec:
    name: str
    ip: str
    labels: dict[str, str]
    annotations: dict[str, str] = field(default_factory=dict)
    ready: bool = True

    def manifest(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": self.name, "namespace": NAMESPACE, "labels": self.labels,
                         "annotations": self.annotations, "resourceVersion": "1"},
            "spec": {"containers": [{"name": "server", "image": "pdserve"}]},
            "status": status(self.ip, self.ready),
        }


def status(ip: str, ready: bool) -> dict[str, Any]:
    flag = "True" if ready else "False"
    return {"phase": "Running", "podIP": ip,
            "conditions": [{"type": "Initialized", "status": "True"}, {"type": "Ready", "status": flag},
                           {"type": "ContainersReady", "status": flag}]}


class FakeKubeApi:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self._emulator: _Emulator | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="fake-kube-api", daemon=True)
        self.http: httpx.Client | None = None

    def start(self) -> None:
        self._thread.start()
        assert self._ready.wait(30), "fake Kubernetes API did not start"
        self.http = httpx.Client(base_url=self.url, timeout=10.0)
        r = self.http.get(f"/api/v1/namespaces/{NAMESPACE}/pods")
        assert r.status_code == 200, r.text

    def _main(self) -> None:
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with _Emulator() as emulator, kmock.Server(emulator) as server:
            emulator.resources["v1/pods"] = kmock.ResourceInfo(namespaced=True, kind="Pod")
            emulator.cut = asyncio.Event()
            self._emulator = emulator
            self.url = str(server.url).rstrip("/")
            self._ready.set()
            await self._stop.wait()

    def stop(self) -> None:
        if self.http is not None:
            self.http.close()
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    # ---- pods, through the API's HTTP endpoints ---------------------------------------------------------
    def _pod_path(self, name: str = "") -> str:
        return f"/api/v1/namespaces/{NAMESPACE}/pods" + (f"/{name}" if name else "")

    def put_pod(self, pod: PodSpec) -> None:
        assert self.http is not None
        r = self.http.post(self._pod_path(), json=pod.manifest())
        if r.status_code == 409:
            r = self.http.patch(self._pod_path(pod.name), json=pod.manifest())
        assert r.status_code == 200, r.text

    def patch(self, name: str, body: dict[str, Any]) -> None:
        assert self.http is not None
        r = self.http.patch(self._pod_path(name), json=body)
        assert r.status_code == 200, r.text

    def set_ready(self, name: str, ip: str, ready: bool) -> None:
        self.patch(name, {"status": status(ip, ready)})

    def delete_pod(self, name: str, *, finalizer: bool = False) -> None:
        """finalizer: the pod stays, with a deletionTimestamp (a terminating pod); else it is gone."""
        assert self.http is not None
        if finalizer:
            self.patch(name, {"metadata": {"finalizers": ["test/hold"]}})
        r = self.http.delete(self._pod_path(name))
        assert r.status_code == 200, r.text

    def release(self, name: str) -> None:
        """Drop the finalizer of a terminating pod: it disappears (DELETED)."""
        self.patch(name, {"metadata": {"finalizers": []}})

    def pods(self) -> list[dict[str, Any]]:
        assert self.http is not None
        return list(self.http.get(self._pod_path()).json()["items"])

    def clear(self) -> None:
        for pod in self.pods():
            name = pod["metadata"]["name"]
            if pod["metadata"].get("finalizers"):
                self.release(name)
            if any(p["metadata"]["name"] == name for p in self.pods()):
                self.delete_pod(name)

    def cut_watches(self, kind: str) -> None:
        """End every open WATCH: "410" (an ERROR event, 410 Gone) or "drop" (the stream just ends)."""
        def cut(em: _Emulator) -> None:
            assert em.cut is not None
            em.cut_kind = kind
            old, em.cut = em.cut, asyncio.Event()
            old.set()
        self._on_loop(cut)

    def mute_watches(self, muted: bool = True) -> None:
        """Watches opened from now on deliver no event (until cut): only a re-LIST sees changes."""
        self._on_loop(lambda em: setattr(em, "muted", muted))

    def fail_lists(self, n: int) -> None:
        self._on_loop(lambda em: setattr(em, "failing_lists", n))

    def _on_loop(self, fn: Callable[[_Emulator], None]) -> None:
        """Run fn on the server's loop and return once it ran."""
        async def run() -> None:
            assert self._emulator is not None
            fn(self._emulator)
        asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters:\n- name: fake\n  cluster:\n    server: {self.url}\n"
            "users:\n- name: router\n  user:\n    token: not-a-real-token\n"
            "contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: router\n"
        )
        return path
