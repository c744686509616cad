"""The optional bearer token of an instance's /metrics (--metrics-token-file, $PDSERVE_METRICS_TOKEN).

    auth = MetricsToken(token)            # None: /metrics stays open
    auth.check(request.headers.get("authorization"))   # ApiError 401 / 403, constant time

Separate from the cluster secret: Prometheus holds this token, never the router's keys.
"""

from __future__ import annotations

import hmac

from common.server.protocol import ApiError


class MetricsToken:
    def __init__(self, token: str | None) -> None:
        self._expected = f"Bearer {token}".encode() if token else None

    def __repr__(self) -> str:
        return "MetricsToken(<hidden>)"

    @property
    def required(self) -> bool:
        return self._expected is not None

    def check(self, authorization: str | None) -> None:
        if self._expected is None:
            return
        if authorization is None:
            raise ApiError(401, "/metrics needs the metrics token (Authorization: Bearer ...)")
        if not hmac.compare_digest(authorization.encode("latin-1", "replace"), self._expected):
            raise ApiError(403, "wrong metrics token")
