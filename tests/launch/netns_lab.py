"""Network namespaces that act as hosts, joined by a bridge, for multi-node launcher tests.

    root namespace: only `ip` commands and a blackhole route for the lab subnet; it never
                    sends a packet to a lab address
    <tag>-sw        bridge br0 (no address)
    <tag>-<addr>    one per host: veth `<tag-short><i>h` with <addr>/24, peer `<tag-short><i>s`
                    in <tag>-sw on br0

          ns <tag>-10.213.K.2        ns <tag>-10.213.K.3        ns <tag>-10.213.K.4
               | veth                     | veth                     | veth
          +----+--------------------------+--------------------------+----+
          |                      br0 in ns <tag>-sw                       |
          +---------------------------------------------------------------+

The subnet 10.213.K.0/24 and every name include the test process id, so concurrent runs do
not collide. `NetnsLab.create()` raises `LabUnavailable` when namespaces are not permitted
(not root, no `ip`); `destroy()` removes everything it made and is safe to call twice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest


class LabUnavailable(RuntimeError):
    """Network namespaces cannot be created here (the test skips with this reason)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


@dataclass
class NetnsLab:
    num_hosts: int
    pid: int = field(default_factory=os.getpid)
    made_namespaces: list[str] = field(default_factory=list)
    made_route: bool = False

    @property
    def tag(self) -> str:
        return f"pdt{self.pid}"

    @property
    def subnet(self) -> str:
        return f"10.213.{100 + self.pid % 150}.0/24"

    def addr(self, i: int) -> str:
        """Address of host i (0-based)."""
        return self.subnet.replace(".0/24", f".{i + 2}")

    def namespace(self, host: str) -> str:
        return f"{self.tag}-{host}"

    @property
    def exec_prefix_template(self) -> str:
        return f"ip netns exec {self.tag}-{{host}}"

    def veth(self, i: int) -> str:
        return f"pv{self.pid % 100000}{i}h"

    def create(self) -> None:
        if os.geteuid() != 0 or shutil.which("ip") is None:
            raise LabUnavailable("network namespaces need root and iproute2")
        route = ip("route", "add", "blackhole", self.subnet, check=False)
        if route.returncode != 0:
            raise LabUnavailable(f"cannot add the blackhole route for {self.subnet}: {route.stderr.strip()}")
        self.made_route = True
        probe = ip("netns", "add", f"{self.tag}-sw", check=False)
        if probe.returncode != 0:
            raise LabUnavailable(f"ip netns add is not permitted: {probe.stderr.strip()}")
        self.made_namespaces.append(f"{self.tag}-sw")
        sw = self.made_namespaces[0]
        ip("-n", sw, "link", "set", "lo", "up")
        ip("-n", sw, "link", "add", "br0", "type", "bridge")
        ip("-n", sw, "link", "set", "br0", "up")
        for i in range(self.num_hosts):
            ns, host_end, sw_end = self.namespace(self.addr(i)), self.veth(i), self.veth(i)[:-1] + "s"
            ip("netns", "add", ns)
            self.made_namespaces.append(ns)
            ip("link", "add", host_end, "netns", ns, "type", "veth", "peer", "name", sw_end, "netns", sw)
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", host_end)
            ip("-n", ns, "link", "set", host_end, "up")
            ip("-n", sw, "link", "set", sw_end, "master", "br0")
            ip("-n", sw, "link", "set", sw_end, "up")

    def run_in(self, host: str, argv: list[str], timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
        """Run argv inside host's namespace (the only way a test talks to lab addresses)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace(host), *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def tx_bytes(self, i: int) -> int:
        res = self.run_in(self.addr(i), ["cat", f"/sys/class/net/{self.veth(i)}/statistics/tx_bytes"])
        return int(res.stdout)

    def destroy(self) -> None:
        for ns in reversed(self.made_namespaces):  # deleting a namespace deletes its veth ends
            ip("netns", "del", ns, check=False)
        self.made_namespaces.clear()
        if self.made_route:
            ip("route", "del", "blackhole", self.subnet, check=False)
            self.made_route = False


def lab_or_skip(num_hosts: int) -> Iterator[NetnsLab]:
    """A fixture body: a created lab (the test skips where namespaces are not permitted),
    destroyed after the test."""
    lab = NetnsLab(num_hosts=num_hosts)
    try:
        try:
            lab.create()
        except LabUnavailable as e:
            pytest.skip(str(e))
        yield lab
    finally:
        lab.destroy()
