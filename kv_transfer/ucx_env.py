"""Pin UCX (the NIXL backend) to the network interface of the instance's --host.

Without this UCX listens on every interface of the machine, whatever --host says.
`pin_ucx_to_host("127.0.0.1")` sets UCX_NET_DEVICES=lo before the NIXL agent exists;
an operator's own UCX_NET_DEVICES wins, and a wildcard host (0.0.0.0, ::) pins nothing.
Call it only in a process that serves one instance (the engine): it sets the environment.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

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


def pin_ucx_to_host(host: str) -> str | None:
    """Set UCX_NET_DEVICES to `host`'s interface unless already set; the value UCX will use."""
    if os.environ.get("UCX_NET_DEVICES"):
        return os.environ["UCX_NET_DEVICES"]
    dev = interface_of(host)
    if dev is None:
        log.warning("UCX not pinned: no interface holds %s (UCX may listen on every interface)", host)
        return None
    os.environ["UCX_NET_DEVICES"] = dev
    return dev
