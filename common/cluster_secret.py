"""The cluster secret: one shared key that every role of a deployment holds.

    secret = ClusterSecret.load(args.cluster_secret_file)   # file, else $PDSERVE_CLUSTER_SECRET, else None
    headers = {"Authorization": secret.bearer()}             # router -> worker HTTP
    ok = secret.accepts(request.headers.get("authorization"))  # worker side, constant time
    keys = secret.curve()                                    # bootstrap ZMQ (kv_transfer), CURVE keys

Nothing derived from it reveals it: HTTP carries HMAC(secret, "http") (a sniffer of the
plain-HTTP control plane learns a token for HTTP, not the key behind the bootstrap
channel), and the CURVE key pairs are derived from it with their own labels.
`require_safe_bind` is the rule for every role: a non-loopback bind address without a
secret needs `--allow-unauthenticated`, and that choice is logged.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.utils import z85

ENV_VAR = "PDSERVE_CLUSTER_SECRET"
MIN_SECRET_BYTES = 16
HEADER = "authorization"
EXEMPT_PATHS = frozenset({"/health", "/metrics"})

logger = logging.getLogger(__name__)


class ClusterSecretError(ValueError):
    """The secret is configured but unusable (missing file, too short)."""


@dataclass(frozen=True)
class CurveKeys:
    """z85 CURVE key pairs: the bootstrap server's (prefill ROUTER) and every client's (decode)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _curve_pair(seed: bytes) -> tuple[bytes, bytes]:
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


class ClusterSecret:
    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ClusterSecretError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes, got {len(key)}")
        self._key = key
        self._bearer = "Bearer " + self.derive(b"http").hex()

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"

    @classmethod
    def load(cls, path: str | None) -> ClusterSecret | None:
        """From `path` (--cluster-secret-file), else $PDSERVE_CLUSTER_SECRET, else None (no secret)."""
        if path:
            p = Path(path)
            try:
                key = p.read_bytes().strip()
            except OSError as e:
                raise ClusterSecretError(f"cannot read --cluster-secret-file {path}: {e.strerror}") from None
            if p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                logger.warning("cluster secret file %s is readable by other users; chmod 600 it", path)
            return cls(key)
        env = os.environ.get(ENV_VAR, "").strip()
        return cls(env.encode()) if env else None

    def derive(self, label: bytes) -> bytes:
        return hmac.new(self._key, b"pdserve/" + label, hashlib.sha256).digest()

    def bearer(self) -> str:
        """The Authorization header value the router presents to workers."""
        return self._bearer

    def accepts(self, authorization: str | None) -> bool:
        """Constant-time check of a request's Authorization header."""
        return authorization is not None and hmac.compare_digest(authorization.encode(), self._bearer.encode())

    def curve(self) -> CurveKeys:
        server_public, server_secret = _curve_pair(self.derive(b"curve-server"))
        client_public, client_secret = _curve_pair(self.derive(b"curve-client"))
        return CurveKeys(server_public, server_secret, client_public, client_secret)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_safe_bind(role: str, host: str, secret: ClusterSecret | None, allow_unauthenticated: bool) -> None:
    """Refuse to serve unauthenticated on a non-loopback address unless explicitly allowed."""
    if secret is not None:
        logger.info("%s: control plane authenticated with the cluster secret", role)
        return
    if is_loopback(host):
        logger.warning("%s: no cluster secret; control plane is unauthenticated (loopback %s only)", role, host)
        return
    if not allow_unauthenticated:
        raise ClusterSecretError(
            f"{role}: --host {host} is not a loopback address and no cluster secret is set "
            f"(--cluster-secret-file or ${ENV_VAR}); pass --allow-unauthenticated to serve without one"
        )
    logger.warning(
        "%s: --allow-unauthenticated: serving on %s WITHOUT a cluster secret; anyone who reaches this "
        "address can submit and abort requests and read KV through the bootstrap port", role, host
    )
