"""Pin UCX (the NIXL backend) to the network interface of the instance's --host.

Without this UCX listens on every interface of the machine, whatever --host says.
`with ucx_pinned_to("127.0.0.1"): make the agent` sets UCX_NET_DEVICES=lo while the
agent's UCX context starts; an operator's own UCX_NET_DEVICES wins, and a wildcard host
(0.0.0.0, ::) pins nothing.

UCX over TCP authenticates nothing: whoever reaches its port can write anywhere in the
process (security review 2, H1; README Security). So a non-loopback host with active RDMA
ports gets those ports instead of its TCP interface (the NIC enforces remote keys), and an
instance whose UCX would still listen on TCP beyond `lo` warns at start.
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
SYS_INFINIBAND = "/sys/class/infiniband"


def rdma_ports(root: str = SYS_INFINIBAND) -> list[str]:
    """Active RDMA ports as UCX names them (`mlx5_0:1`); [] on a machine without any."""
    out = []
    for dev in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        ports = os.path.join(root, dev, "ports")
        for port in sorted(os.listdir(ports)) if os.path.isdir(ports) else []:
            try:
                with open(os.path.join(ports, port, "state")) as f:
                    state = f.read()
            except OSError:
                continue
            if "ACTIVE" in state:
                out.append(f"{dev}:{port}")
    return out


def tcp_devices(net_devices: str | None, tls: str | None) -> list[str]:
    """Where UCX would listen on TCP beyond `lo`, given UCX_NET_DEVICES and UCX_TLS:
    ["all"] when unpinned, the netdev names otherwise (RDMA ports, `dev:port`, are not TCP)."""
    if tls:
        names = [t.strip() for t in tls.removeprefix("^").split(",")]
        excluded = tls.startswith("^")
        if (excluded and "tcp" in names) or (not excluded and "tcp" not in names and "all" not in names):
            return []
    if not net_devices or net_devices.strip() == "all":
        return ["all"]
    return [d.strip() for d in net_devices.split(",") if d.strip() and ":" not in d and d.strip() != "lo"]


def warn_if_tcp_exposed(host: str) -> None:
    """One warning at start when this agent's UCX listens on TCP on a network interface."""
    exposed = tcp_devices(os.environ.get("UCX_NET_DEVICES"), os.environ.get("UCX_TLS"))
    if exposed:
        ports = os.environ.get("UCX_TCP_PORT_RANGE", "ephemeral")
        log.warning(
            "UCX uses TCP on %s (--host %s, ports %s): it authenticates nothing, anyone who reaches those "
            "ports can write into this process's memory; keep the KV network isolated (README: Security, H1)",
            ",".join(exposed), host, ports)


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
        warn_if_tcp_exposed(host)
        yield preset
        return
    dev = interface_of(host)
    if dev is None:
        if host not in ("0.0.0.0", "::", ""):
            log.warning("UCX not pinned: no interface holds %s (UCX may listen on every interface)", host)
        warn_if_tcp_exposed(host)
        yield None
        return
    rdma = rdma_ports() if dev != "lo" else []
    if rdma:
        log.info("UCX on RDMA ports %s instead of TCP on %s", ",".join(rdma), dev)
        dev = ",".join(rdma)
    os.environ["UCX_NET_DEVICES"] = dev
    try:
        warn_if_tcp_exposed(host)
        yield dev
    finally:
        os.environ.pop("UCX_NET_DEVICES", None)
