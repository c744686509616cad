"""Security review 2, H1: UCX over TCP writes wherever a PUT header says.

Against the bundled UCX (nixl 1.5.1's, UCX 1.23), a real NixlEndpoint pinned as every instance's
is holds a zeroed canary; a raw TCP client that never saw NIXL metadata writes into it with one
connection (tests/security/ucx_peers.py speaks UCT's tcp wire format). What stays true after the
fix is the property itself, so the tests pin down the isolation the README prescribes:
- on a shared `lo` every local process can write (the property: the data plane trusts its network);
- between two hosts (network namespaces) a neighbour can write, and the instance warned at start
  that UCX uses TCP on a non-loopback interface;
- in a private network namespace (the single-host recipe) the same victim on `lo` is out of
  reach of the host's `lo`, and reachable from inside its namespace.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.process import ChildProcess, wait_until
from tests.launch.netns_lab import NetnsLab, lab_or_skip
from tests.security.ucx_peers import attack

CANARY_TEXT = "written-by-a-stranger"
PORT_RANGE = "47100-47899"
UCT_CONN_ACK_AND_PUT_ACK = "2004000000020000002204000000"  # CM ACK event 2; PUT_ACK am 34 (prefix checked)


def _peer(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.security.ucx_peers", *args]


def _lines(child: ChildProcess) -> list[dict[str, Any]]:
    out = []
    for line in child.log(None).splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _record(child: ChildProcess, key: str, timeout_s: float = 60.0) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def ready() -> bool:
        found[:] = [d for d in _lines(child) if key in d]
        return bool(found) or not child.alive

    wait_until(ready, timeout_s)
    assert found, f"no {key} from {child.name}: {child.log()}"
    return found[0]


def _victim(host: str, netns: str | None = None, env: dict[str, str] | None = None) -> ChildProcess:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return ChildProcess([*prefix, *_peer("victim", host)], f"ucx-victim-{host}", env=env)


def _attack_from_here(host: str, victim: dict[str, Any]) -> list[str]:
    """Every listening port of the victim gets the PUT; returns the replies (hex)."""
    replies = []
    for port in victim["ports"]:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                attack(host, port, victim["addr"], CANARY_TEXT)
            except OSError as e:
                print(json.dumps({"reply": "", "error": str(e)}))
        replies.append(json.loads(buf.getvalue())["reply"])
    return replies


def test_h1_any_local_process_writes_into_an_instance_over_lo() -> None:
    """The property on one host without isolation: no NIXL metadata, no key, one connection.
    UCX honours a pinned UCX_TCP_PORT_RANGE (what pd.sh --ucx-tcp-port-range sets for firewalls)."""
    v = _victim("127.0.0.1", env={"UCX_TCP_PORT_RANGE": PORT_RANGE})
    try:
        victim = _record(v, "addr")
        lo, hi = map(int, PORT_RANGE.split("-"))
        assert victim["ports"] and all(lo <= p <= hi for p in victim["ports"]), victim
        replies = _attack_from_here("127.0.0.1", victim)
        assert _record(v, "canary", 30)["canary"] == CANARY_TEXT, v.log()
        assert any(r.startswith(UCT_CONN_ACK_AND_PUT_ACK[:18]) for r in replies), replies  # UCX said CONN_ACK
        assert "UCX uses TCP" not in v.log(None)  # loopback: no network-facing warning
    finally:
        v.close()


@pytest.fixture
def lab() -> Iterator[NetnsLab]:
    yield from lab_or_skip(2)


def test_h1_a_neighbour_writes_across_hosts_and_the_instance_warned(lab: NetnsLab) -> None:
    a, b = lab.addr(0), lab.addr(1)
    v = _victim(a, lab.namespace(a))
    try:
        victim = _record(v, "addr")
        port = victim["ports"][0]
        res = lab.run_in(b, _peer("attack", a, str(port), str(victim["addr"]), CANARY_TEXT))
        assert res.returncode == 0, res.stderr
        assert _record(v, "canary", 30)["canary"] == CANARY_TEXT, v.log()
        log = v.log(None)
        assert "UCX uses TCP on" in log and a in log, log  # the start-up warning names the exposure
    finally:
        v.close()


def test_h1_a_private_namespace_keeps_the_hosts_lo_out(lab: NetnsLab) -> None:
    """Single-host recipe: the deployment's roles in their own netns, pinned to its `lo`."""
    a = lab.addr(0)
    v = _victim("127.0.0.1", lab.namespace(a))
    try:
        victim = _record(v, "addr")
        outside = _attack_from_here("127.0.0.1", victim)  # this test runs in the host's namespace
        assert not any(r.startswith(UCT_CONN_ACK_AND_PUT_ACK[:18]) for r in outside), outside
        assert not any("canary" in d for d in _lines(v)), v.log()
        res = lab.run_in(a, _peer("attack", "127.0.0.1", str(victim["ports"][0]), str(victim["addr"]), CANARY_TEXT))
        assert res.returncode == 0, res.stderr
        assert _record(v, "canary", 30)["canary"] == CANARY_TEXT, v.log()  # inside: still the same property
    finally:
        v.close()


def test_h1_where_ucx_listens_on_tcp(tmp_path: Path) -> None:
    """The warning's rule (UCX_NET_DEVICES x UCX_TLS) and the RDMA ports preferred over TCP."""
    from kv_transfer.ucx_env import rdma_ports, tcp_devices

    assert tcp_devices("lo", None) == [] and tcp_devices("mlx5_0:1", None) == []
    assert tcp_devices("eth0", None) == ["eth0"] and tcp_devices(None, None) == ["all"]
    assert tcp_devices("eth0,mlx5_0:1", "^cma") == ["eth0"] and tcp_devices("eth0", "all") == ["eth0"]
    assert tcp_devices("eth0", "^tcp") == [] and tcp_devices("eth0", "rc,sm,cuda_copy") == []
    for dev, port, state in (("mlx5_0", "1", "4: ACTIVE"), ("mlx5_1", "1", "1: DOWN"), ("mlx5_1", "2", "4: ACTIVE")):
        (tmp_path / dev / "ports" / port).mkdir(parents=True)
        (tmp_path / dev / "ports" / port / "state").write_text(state + "\n")
    assert rdma_ports(str(tmp_path)) == ["mlx5_0:1", "mlx5_1:2"]
    assert rdma_ports(str(tmp_path / "absent")) == []
