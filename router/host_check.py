"""DNS rebinding guard: which `Host` headers an unauthenticated loopback router answers.

A web page whose name rebinds to 127.0.0.1 can make same-origin requests to a router on
loopback; its requests still carry the page's own name in `Host`. When nothing else protects
the router (no --api-key) and it is bound to loopback, only loopback hosts and the names
in --allowed-hosts are answered (421 otherwise). A router with a key, or one bound to a public
address, checks Host only when --allowed-hosts is given.
"""

from __future__ import annotations

import ipaddress

from common.cluster_secret import is_loopback


class HostAllowlist:
    """Owned by the router's AuthMiddleware; `allows` sees the raw Host header (None: absent)."""

    def __init__(self, bind_host: str, api_key_set: bool, allowed_hosts: tuple[str, ...]) -> None:
        self.names = frozenset(h.lower() for h in allowed_hosts)
        self.active = bool(self.names) or (not api_key_set and is_loopback(bind_host))
        self.loopback_ok = not self.names or is_loopback(bind_host)

    def allows(self, host_header: bytes | None) -> bool:
        if not self.active or host_header is None:
            return True
        name = _hostname(host_header.decode("latin-1").strip().lower())
        if name in self.names:
            return True
        return self.loopback_ok and (name == "localhost" or _is_loopback_ip(name))


def _hostname(host: str) -> str:
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_loopback_ip(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False
