"""The cluster secret: one shared key that every instance holds; the router gets derived keys only.

    secret = ClusterSecret.load(args.cluster_secret_file)   # file, else $PDSERVE_CLUSTER_SECRET, else None
    verifier = secret.verifier()                             # worker side: per-request MACs (common.request_mac)
    keys = secret.curve()                                    # bootstrap ZMQ (kv_transfer), CURVE keys
    events = secret.events_curve()                           # KV events PUB (CURVE server)
    router = load_router_keys(cfg.cluster_secret_file)       # the router: RouterKeys, never the secret
    headers["Authorization"] = router.signer().sign("POST", "/generate", body)

The secret must be strong (MIN_SECRET_BYTES, not a repeated pattern) and is stretched with
scrypt before anything is derived, so an offline guess from a captured MAC costs a memory-hard
KDF per guess. Every key is HMAC(stretched, "pdserve/" + label): one per purpose. The router's
key file (`python -m common.cluster_secret router-keys`) holds only the HTTP MAC key and the KV
events client key pair: a compromised router can call workers, but cannot act as a prefill's
bootstrap server or as a decode towards one, and cannot recover the secret.
`require_safe_bind` is the rule for every role: a non-loopback bind address without a
secret needs `--allow-unauthenticated`, and that choice is logged.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import stat
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
import zmq
from zmq.utils import z85

from common.request_mac import RequestSigner, RequestVerifier

ENV_VAR = "PDSERVE_CLUSTER_SECRET"
MIN_SECRET_BYTES = 32
MIN_SECRET_BITS = 96  # length x log2(distinct bytes): refuses "aaaa...", "abab..."; random hex has ~128+
HEADER = "authorization"
EXEMPT_PATHS = frozenset({"/health", "/metrics"})
ROUTER_KEYS_FORMAT = "pdserve-router-keys/1"
_SCRYPT = {"n": 1 << 14, "r": 8, "p": 1}  # ~16 MiB, ~0.1 s once per process

logger = logging.getLogger(__name__)


class ClusterSecretError(ValueError):
    """The secret is configured but unusable (missing file, too short, too weak)."""


@dataclass(frozen=True)
class CurveKeys:
    """z85 CURVE key pairs of one channel: its server's and its clients'. server_secret is b""
    where only the client side is held (the router's KV events keys)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _curve_pair(seed: bytes) -> tuple[bytes, bytes]:
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


def check_strength(key: bytes) -> None:
    if len(key) < MIN_SECRET_BYTES:
        raise ClusterSecretError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes "
                                 f"(e.g. `openssl rand -hex 32`), got {len(key)}")
    if len(key) * math.log2(max(len(set(key)), 1)) < MIN_SECRET_BITS:
        raise ClusterSecretError("the cluster secret is a repeated pattern, not random bytes "
                                 "(e.g. `openssl rand -hex 32`)")


@functools.lru_cache(maxsize=8)
def _stretch(key: bytes) -> bytes:
    return hashlib.scrypt(key, salt=b"pdserve/cluster-secret", dklen=32, **_SCRYPT)


class ClusterSecret:
    """Held by instances (frontend, engine, kv_transfer); the router holds RouterKeys instead."""

    def __init__(self, key: bytes) -> None:
        check_strength(key)
        self._root = _stretch(key)

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"

    @classmethod
    def load(cls, path: str | None) -> ClusterSecret | None:
        """From `path` (--cluster-secret-file), else $PDSERVE_CLUSTER_SECRET, else None (no secret)."""
        raw = _read(path)
        return cls(raw) if raw is not None else None

    def derive(self, label: bytes) -> bytes:
        return hmac.new(self._root, b"pdserve/" + label, hashlib.sha256).digest()

    def verifier(self) -> RequestVerifier:
        """The worker side of router -> worker HTTP (one per worker process: it remembers nonces)."""
        return RequestVerifier(self.derive(b"http-mac"))

    def curve(self) -> CurveKeys:
        """The bootstrap channel: prefill's ROUTER is the server, decodes are the clients."""
        server_public, server_secret = _curve_pair(self.derive(b"curve-server"))
        client_public, client_secret = _curve_pair(self.derive(b"curve-client"))
        return CurveKeys(server_public, server_secret, client_public, client_secret)

    def events_curve(self) -> CurveKeys:
        """The KV events channel: an instance's PUB is the server, the router the client."""
        server_public, server_secret = _curve_pair(self.derive(b"curve-events-server"))
        client_public, client_secret = _curve_pair(self.derive(b"curve-events-client"))
        return CurveKeys(server_public, server_secret, client_public, client_secret)

    def router_keys(self) -> RouterKeys:
        return RouterKeys(self.derive(b"http-mac"), replace(self.events_curve(), server_secret=b""))


class _RouterKeysFile(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    http_mac_key: str
    events_server_public: str
    events_client_public: str
    events_client_secret: str


@dataclass(frozen=True, repr=False)
class RouterKeys:
    """What the router holds: the HTTP MAC key and the KV events client key pair."""

    http_mac_key: bytes
    events: CurveKeys

    def __repr__(self) -> str:
        return "RouterKeys(<hidden>)"

    def signer(self) -> RequestSigner:
        return RequestSigner(self.http_mac_key)

    def encode(self) -> bytes:
        e = self.events
        return msgspec.json.encode(_RouterKeysFile(ROUTER_KEYS_FORMAT, self.http_mac_key.hex(), e.server_public.decode(),
                                                   e.client_public.decode(), e.client_secret.decode())) + b"\n"

    @classmethod
    def decode(cls, raw: bytes) -> RouterKeys | None:
        """None when `raw` is not a router keys file (then it may be the secret itself)."""
        if not raw.lstrip().startswith(b"{"):
            return None
        try:
            f = msgspec.json.decode(raw, type=_RouterKeysFile)
            key = bytes.fromhex(f.http_mac_key)
        except (msgspec.DecodeError, ValueError) as e:
            raise ClusterSecretError(f"not a valid router keys file: {e}") from None
        if f.format != ROUTER_KEYS_FORMAT or len(key) != 32:
            raise ClusterSecretError(f"not a {ROUTER_KEYS_FORMAT} file")
        return cls(key, CurveKeys(f.events_server_public.encode(), b"", f.events_client_public.encode(),
                                  f.events_client_secret.encode()))


def _read(path: str | None) -> bytes | None:
    if path:
        p = Path(path)
        try:
            raw = p.read_bytes().strip()
        except OSError as e:
            raise ClusterSecretError(f"cannot read --cluster-secret-file {path}: {e.strerror}") from None
        if p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("cluster secret file %s is readable by other users; chmod 600 it", path)
        return raw
    env = os.environ.get(ENV_VAR, "").strip()
    return env.encode() if env else None


def load_router_keys(path: str | None) -> RouterKeys | None:
    """The router's --cluster-secret-file: a router keys file; the cluster secret itself (or
    $PDSERVE_CLUSTER_SECRET) still works, with a warning; None: no secret."""
    raw = _read(path)
    if raw is None:
        return None
    keys = RouterKeys.decode(raw)
    if keys is not None:
        return keys
    logger.warning("the router holds the cluster secret itself; give it only derived keys: "
                   "python -m common.cluster_secret router-keys < secret > router_keys (chmod 600)")
    return ClusterSecret(raw).router_keys()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_safe_bind(role: str, host: str, secret: ClusterSecret | RouterKeys | None,
                      allow_unauthenticated: bool) -> None:
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


def main(argv: list[str] | None = None) -> int:
    """`python -m common.cluster_secret router-keys [--cluster-secret-file F]`: the router's key
    file on stdout, from F, else $PDSERVE_CLUSTER_SECRET, else the secret on stdin."""
    p = argparse.ArgumentParser(prog="python -m common.cluster_secret")
    p.add_argument("command", choices=["router-keys"])
    p.add_argument("--cluster-secret-file", default=None)
    args = p.parse_args(argv)
    try:
        secret = ClusterSecret.load(args.cluster_secret_file)
        if secret is None:
            secret = ClusterSecret(sys.stdin.buffer.read().strip())
    except ClusterSecretError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.buffer.write(secret.router_keys().encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
