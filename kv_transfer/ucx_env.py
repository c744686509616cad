"""Pin UCX (the NIXL backend) to the network interface of the instance's --host.

Without this UCX listens on every interface of the machine, whatever --host says.
`with ucx_pinned_to("127.0.0.1"): make the agent` sets UCX_NET_DEVICES=lo while the
agent's UCX context starts; an operator's own UCX_NET_DEVICES wins, and a wildcard host
(0.0.0.0, ::) pins nothing.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import Iterator

log = logging.getLogger("kv_transfer")
SIOCGIFADDR = 0x8915


def _ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", ifname[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def _ipv6_interfaces(addr: ipaddress.IPv6Address) -> list[str]:
    try:
        lines = open("/proc/net/if_inet6").read().splitlines()
    except OSError:
        return []
    return [f[5] for f in (ln.split() for ln in lines) if len(f) == 6 and ipaddress.IPv6Address(int(f[0], 16)) == addr]


def interface_of(host: str) -> str | None:
    """The interface holding `host`'s address; None for a wildcard or an address no interface has."""
    try:
        addr = ipaddress.ip_address(host if host != "localhost" else "127.0.0.1")
    except ValueError:
        try:
            addr = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError:
            return None
    if addr.is_unspecified:
        return None
    if addr.is_loopback:
        return "lo"
    if isinstance(addr, ipaddress.IPv6Address):
        names = _ipv6_interfaces(addr)
        return names[0] if names else None
    return next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == str(addr)), None)


@contextlib.contextmanager
def ucx_pinned_to(host: str) -> Iterator[str | None]:
    """While creating a NIXL agent: UCX_NET_DEVICES = `host`'s interface (UCX reads it when the
    backend starts), restored afterwards so nothing else in the process inherits it. An
    operator's own UCX_NET_DEVICES wins; a wildcard host pins nothing."""
    preset = os.environ.get("UCX_NET_DEVICES")
    if preset:
        yield preset
        return
    dev = interface_of(host)
    if dev is None:
        if host not in ("0.0.0.0", "::", ""):
            log.warning("UCX not pinned: no interface holds %s (UCX may listen on every interface)", host)
        yield None
        return
    os.environ["UCX_NET_DEVICES"] = dev
    try:
        yield dev
    finally:
        os.environ.pop("UCX_NET_DEVICES", None)
