"""The router's credential on its httpx clients (health, load): a per-request MAC, none on /health.

    client = httpx.AsyncClient(auth=WorkerAuth(signer))   # signer None: no credential at all

/health is open on workers, so a probe of it carries nothing a listener could use; every other
request gets `Authorization: PDS-HMAC-SHA256 ...` over its method, target and body
(common.request_mac). The hot path (router/http_client.py) signs the same way itself.
"""

from __future__ import annotations

from collections.abc import Generator

import httpx

from common.cluster_secret import EXEMPT_PATHS
from common.request_mac import RequestSigner


class WorkerAuth(httpx.Auth):
    requires_request_body = True

    def __init__(self, signer: RequestSigner | None) -> None:
        self.signer = signer

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if self.signer is not None and request.url.path not in EXEMPT_PATHS:
            request.headers["Authorization"] = self.signer.sign(request.method, request.url.raw_path.decode("ascii"),
                                                                request.content)
        yield request
