"""Pods through the Kubernetes API with plain httpx: credentials, LIST, WATCH.

    KubeCredentials.in_cluster()            the pod's service account: token + CA under
                                            /var/run/secrets/kubernetes.io/serviceaccount,
                                            KUBERNETES_SERVICE_HOST/PORT
    KubeCredentials.from_kubeconfig(path)   a router outside the cluster: the current context's
                                            server, CA, bearer token (or token file) or client cert
    KubeClient.list_pods(ns) -> PodList     one LIST
    KubeClient.watch_pods(ns, rv, s)        WATCH from a resourceVersion for at most s seconds;
                                            yields (type, Pod); raises WatchExpired on 410 Gone

The service account token is read again for every request (projected tokens rotate). The
caller owns the client (close it); every request is bounded by the given timeouts.
"""

from __future__ import annotations

import base64
import os
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import yaml

from router.discovery.kube_types import Pod, PodList, Status, WatchEvent

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeApiError(Exception):
    """The API answered something the router cannot use (an HTTP error, a bad body)."""


class WatchExpired(KubeApiError):
    """410 Gone: the resourceVersion is too old; LIST again."""


@dataclass(frozen=True)
class KubeCredentials:
    server: str
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None  # read for every request (rotating service account tokens)
    ca_file: str | None = None
    ca_data: str | None = field(default=None, repr=False)  # PEM
    client_cert: tuple[str, str] | None = None  # (cert file, key file)
    insecure: bool = False

    @classmethod
    def in_cluster(cls, sa_dir: Path = SERVICE_ACCOUNT_DIR) -> KubeCredentials:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubeApiError("not in a cluster (KUBERNETES_SERVICE_HOST unset): pass --kubeconfig")
        host = f"[{host}]" if ":" in host else host
        ca = sa_dir / "ca.crt"
        return cls(f"https://{host}:{port}", token_file=str(sa_dir / "token"),
                   ca_file=str(ca) if ca.exists() else None)

    @classmethod
    def from_kubeconfig(cls, path: str, context: str | None = None) -> KubeCredentials:
        doc: dict[str, Any] = yaml.safe_load(Path(path).read_text()) or {}
        base = Path(path).resolve().parent
        name = context or doc.get("current-context")
        ctx = _named(doc, "contexts", name, "context")
        cluster = _named(doc, "clusters", ctx.get("cluster"), "cluster")
        user = _named(doc, "users", ctx.get("user"), "user") if ctx.get("user") else {}

        def rel(p: str | None) -> str | None:
            return None if p is None else str(base / p)

        if "server" not in cluster:
            raise KubeApiError(f"{path}: cluster {ctx.get('cluster')!r} has no server")
        ca_data = cluster.get("certificate-authority-data")
        cert = (rel(user.get("client-certificate")), rel(user.get("client-key")))
        return cls(
            server=str(cluster["server"]).rstrip("/"),
            token=user.get("token"),
            token_file=rel(user.get("tokenFile")),
            ca_file=rel(cluster.get("certificate-authority")),
            ca_data=base64.b64decode(ca_data).decode() if ca_data else None,
            client_cert=(cert[0], cert[1]) if cert[0] and cert[1] else None,
            insecure=bool(cluster.get("insecure-skip-tls-verify", False)),
        )

    def headers(self) -> dict[str, str]:
        token = self.token
        if self.token_file is not None:
            token = Path(self.token_file).read_text().strip()
        return {"Authorization": f"Bearer {token}"} if token else {}

    def verify(self) -> ssl.SSLContext | bool:
        if not self.server.startswith("https://"):
            return True
        if self.insecure:
            return False
        ctx = ssl.create_default_context(cafile=self.ca_file, cadata=self.ca_data)
        if self.client_cert is not None:
            ctx.load_cert_chain(*self.client_cert)
        return ctx


def _named(doc: dict[str, Any], section: str, name: object, inner: str) -> dict[str, Any]:
    for entry in doc.get(section) or []:
        if entry.get("name") == name:
            return dict(entry.get(inner) or {})
    raise KubeApiError(f"kubeconfig: no {section[:-1]} named {name!r}")


class KubeClient:
    """One httpx client to the API server; owned by ServiceDiscovery."""

    def __init__(self, creds: KubeCredentials, request_timeout_s: float = 10.0) -> None:
        self.creds = creds
        self.request_timeout_s = request_timeout_s
        self._http = httpx.AsyncClient(base_url=creds.server, verify=creds.verify(), trust_env=False,
                                       timeout=httpx.Timeout(request_timeout_s))

    async def close(self) -> None:
        await self._http.aclose()

    @staticmethod
    def pods_path(namespace: str | None) -> str:
        return f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"

    async def list_pods(self, namespace: str | None, label_selector: str = "") -> PodList:
        params = {"labelSelector": label_selector} if label_selector else {}
        r = await self._http.get(self.pods_path(namespace), params=params, headers=self.creds.headers())
        if r.status_code != 200:
            raise KubeApiError(f"LIST pods: HTTP {r.status_code}: {r.text[:200]}")
        try:
            return msgspec.json.decode(r.content, type=PodList)
        except msgspec.ValidationError as e:
            raise KubeApiError(f"LIST pods: {e}") from None

    async def watch_pods(self, namespace: str | None, resource_version: str, seconds: float,
                         label_selector: str = "") -> AsyncIterator[tuple[str, Pod]]:
        params = {"watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(max(1, int(seconds)))}
        if resource_version:
            params["resourceVersion"] = resource_version
        if label_selector:
            params["labelSelector"] = label_selector
        timeout = httpx.Timeout(self.request_timeout_s, read=seconds + self.request_timeout_s)
        async with self._http.stream("GET", self.pods_path(namespace), params=params,
                                     headers=self.creds.headers(), timeout=timeout) as r:
            if r.status_code == 410:
                raise WatchExpired("WATCH pods: HTTP 410 Gone")
            if r.status_code != 200:
                await r.aread()
                raise KubeApiError(f"WATCH pods: HTTP {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                try:
                    ev = msgspec.json.decode(line, type=WatchEvent)
                    if ev.type == "ERROR":
                        status = msgspec.json.decode(ev.object, type=Status)
                        if status.code == 410:
                            raise WatchExpired(f"WATCH pods: 410 Gone ({status.message})")
                        raise KubeApiError(f"WATCH pods: ERROR {status.code} {status.reason}: {status.message}")
                    yield ev.type, msgspec.json.decode(ev.object, type=Pod)
                except msgspec.ValidationError as e:
                    raise KubeApiError(f"WATCH pods: bad event: {e}") from None


__all__ = ["KubeApiError", "KubeClient", "KubeCredentials", "WatchExpired"]
