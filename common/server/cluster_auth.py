"""Workers require the router's per-request MAC on every HTTP endpoint but /health and /metrics.

A pure ASGI wrapper (no per-request Starlette middleware machinery on the hot path):

    app = ClusterAuth(app, secret)   # secret None: passes everything through unchanged

The header (common.request_mac) is checked for shape and time window before any body byte
is read (missing -> 401, malformed or stale -> 403); then the body is read (up to
MAX_BODY_BYTES, else 413), the MAC over method, target, time, nonce and body hash checked,
and the nonce spent: a replayed or altered request gets 403. The app then reads the buffered
body as usual. /health stays open (load balancers and pd.sh probe it); /metrics has its own
optional token (--metrics-token-file) and carries only aggregate counters and gauges.
"""

from __future__ import annotations

from typing import Any

import msgspec

from common.cluster_secret import EXEMPT_PATHS, HEADER, ClusterSecret
from common.request_mac import SCHEME
from common.server.protocol import MAX_BODY_BYTES, error_body

_HEADER = HEADER.encode()


class ClusterAuth:
    def __init__(self, app: Any, secret: ClusterSecret | None) -> None:
        self.app = app
        self.verifier = secret.verifier() if secret is not None else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.verifier is None or scope["type"] != "http" or scope["path"] in EXEMPT_PATHS:
            await self.app(scope, receive, send)
            return
        value = next((v for k, v in scope["headers"] if k == _HEADER), None)
        claim = self.verifier.claim(value.decode("latin-1")) if value is not None else None
        if claim is None:
            await _refuse(send, 401 if value is None else 403,
                          "missing cluster credentials" if value is None else "wrong or expired cluster credentials")
            return
        body = await _read_body(receive)
        if isinstance(body, _Gone):
            return  # the client left before its body arrived
        if body is None:
            await _refuse(send, 413, f"request body is larger than {MAX_BODY_BYTES} bytes")
            return
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        if not self.verifier.verify(claim, scope["method"], target.decode("latin-1"), body):
            await _refuse(send, 403, "wrong, altered or replayed cluster credentials")
            return
        await self.app(scope, _replay(body, receive), send)


class _Gone:
    pass


async def _read_body(receive: Any) -> bytes | _Gone | None:
    """The whole body; None past MAX_BODY_BYTES; _Gone when the client disconnected."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return _Gone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def replayed() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()  # http.disconnect, when it comes
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


async def _refuse(send: Any, status: int, why: str) -> None:
    body = msgspec.json.encode(error_body(status, f"{why}: this endpoint is for the router only"))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]  # the body may be unread
    if status == 401:
        headers.append((b"www-authenticate", f'{SCHEME} realm="pdserve-cluster"'.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
