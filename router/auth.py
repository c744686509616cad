"""Who may call which route of the router: one ASGI middleware, checked before any body is read.

    /v1/*, /generate   client routes: `Authorization: Bearer <--api-key>` when one is set
                       (vLLM's and SGLang's flag), else open; 401 otherwise
    /workers           worker admin: `Authorization: Bearer <--admin-api-key>`; with no admin
                       key configured the routes answer 403 naming the flag (admin is off)
    everything else    open (/health, /metrics): load balancers and Prometheus scrape them
    any route          421 when `Host` is not allowed (router/host_check.py: DNS rebinding)

Keys are compared with hmac.compare_digest. Errors are in the OpenAI shape, so the
`openai` client raises AuthenticationError / PermissionDeniedError.
"""

from __future__ import annotations

import hmac
from typing import Any

from router.errors import ApiError
from router.host_check import HostAllowlist

ADMIN_PREFIX = "/workers"
_CLIENT_EXACT = frozenset({"/generate"})


def _header(scope: dict[str, Any], wanted: bytes) -> bytes | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return bytes(value)
    return None


def _bearer(scope: dict[str, Any]) -> bytes | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


def _matches(token: bytes | None, key: bytes) -> bool:
    return token is not None and hmac.compare_digest(token, key)


class AuthMiddleware:
    """ASGI middleware; the app behind it sees only requests that passed."""

    def __init__(self, app: Any, api_key: str | None, admin_api_key: str | None,
                 hosts: HostAllowlist | None = None) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.admin_key = admin_api_key.encode() if admin_api_key else None
        self.hosts = hosts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            err = self.refusal(scope["path"], scope)
            if err is not None:
                await _send_error(send, err)
                return
        await self.app(scope, receive, send)

    def refusal(self, path: str, scope: dict[str, Any]) -> ApiError | None:
        if self.hosts is not None and not self.hosts.allows(_header(scope, b"host")):
            return ApiError(421, "this router does not serve that Host (--allowed-hosts)", code="misdirected_request")
        if path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/"):
            if self.admin_key is None:
                return ApiError(403, "worker admin is off: start the router with --admin-api-key "
                                     "(or PDSERVE_ADMIN_API_KEY) to use /workers",
                                type="permission_error", code="admin_disabled")
            if not _matches(_bearer(scope), self.admin_key):
                return _unauthorized("a valid admin key (--admin-api-key) is required for /workers")
            return None
        if self.api_key is not None and (path.startswith("/v1/") or path in _CLIENT_EXACT):
            if not _matches(_bearer(scope), self.api_key):
                return _unauthorized("Incorrect API key provided; send 'Authorization: Bearer <key>'")
        return None


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, type="invalid_request_error", code="invalid_api_key")


async def _send_error(send: Any, err: ApiError) -> None:
    body = err.encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
