"""Workers require the cluster secret on every HTTP endpoint but /health and /metrics.

A pure ASGI wrapper (no per-request Starlette middleware machinery on the hot path):

    app = ClusterAuth(app, secret)   # secret None: passes everything through unchanged

Missing Authorization -> 401, a wrong one -> 403, both in the instance's error shape.
/health stays open (load balancers and pd.sh probe it); /metrics stays open because
Prometheus scrapers rarely hold cluster credentials and it carries only aggregate
counters and gauges: no request content, ids, addresses or paths.
"""

from __future__ import annotations

from typing import Any

import msgspec

from common.cluster_secret import EXEMPT_PATHS, HEADER, ClusterSecret
from common.server.protocol import error_body

_HEADER = HEADER.encode()


class ClusterAuth:
    def __init__(self, app: Any, secret: ClusterSecret | None) -> None:
        self.app = app
        self.secret = secret

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.secret is None or scope["type"] != "http" or scope["path"] in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        value = next((v for k, v in scope["headers"] if k == _HEADER), None)
        if value is not None and self.secret.accepts(value.decode("latin-1")):
            await self.app(scope, receive, send)
            return
        status = 401 if value is None else 403
        why = "missing cluster credentials" if value is None else "wrong cluster credentials"
        body = msgspec.json.encode(error_body(status, f"{why}: this endpoint is for the router only"))
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="pdserve-cluster"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
