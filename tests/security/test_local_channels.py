"""Security review 2, the local channels of an instance (each attacked from another process):

M5  TP ranks met over abstract unix sockets (no permissions, listed in /proc/net/unix) and rank 0
    took a rank's report from any connection: now one 0700 directory for the ranks' store and
    sockets, and a RankDone/RankHello counts only from that rank's own connection.
L7  frontend<->engine sockets were files in /tmp with the umask's mode: now in a 0700 directory.
L10 gloo/NCCL listened on the hostname's interface: now on --host's.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from common.server.ipc import EngineIpcAddrs, FrontendChannel
from common.server.tp_ranks import TPAddrs
from kv_transfer import FaultSpec, TransferConfig
from kv_transfer.faults import FaultInjector
from kv_transfer.nixl_endpoint import NixlEndpoint
from kv_transfer.rank_agent import RankAgent, RankAgentArgs
from kv_transfer.rank_link import RankLink
from kv_transfer.rank_messages import RankDone, RankHello, encode
from tests.harness.process import ChildProcess, wait_until
from tests.launch.netns_lab import NetnsLab, lab_or_skip

NOBODY = 65534
TIMEOUT_S = 10.0


OUTCOMES = ("connected", "PermissionError", "FileNotFoundError", "ConnectionRefusedError", "OSError")


def connect_as_nobody(path: str) -> str:
    """'connected', or the error a process of another user gets connecting to the unix socket
    (a forked child: it needs no executable it could not read)."""
    if os.geteuid() != 0:
        pytest.skip("switching to another user needs root")
    pid = os.fork()
    if pid == 0:  # the child: setuid, one connect, exit with the outcome's index
        code = 4
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(path)
            code = 0
        except PermissionError:
            code = 1
        except FileNotFoundError:
            code = 2
        except ConnectionRefusedError:
            code = 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return OUTCOMES[os.waitstatus_to_exitcode(status)]


def test_l7_engine_ipc_sockets_sit_in_a_private_directory() -> None:
    """Under umask 000 (some containers) the old sockets were world-connectable files in /tmp."""
    old = os.umask(0)
    try:
        addrs = EngineIpcAddrs.new("pdserve_sec")
        frontend = FrontendChannel(addrs)  # binds both sockets, as an instance's frontend does
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.stat(addrs.dir).st_mode) == 0o700
        for addr in (addrs.requests, addrs.replies):
            path = addr.removeprefix("ipc://")
            assert os.path.dirname(path) == addrs.dir and stat.S_ISSOCK(os.stat(path).st_mode)
            assert connect_as_nobody(path) == "PermissionError"
        assert connect_as_nobody(addrs.requests.removeprefix("ipc://")) != "connected"
    finally:
        frontend.close()
    assert not os.path.exists(addrs.dir)  # close() removes the directory and all in it


def test_m5_tp_addresses_are_files_in_a_private_directory() -> None:
    addrs = TPAddrs.new(3, kv_files=True)
    try:
        assert stat.S_IMODE(os.stat(addrs.dir).st_mode) == 0o700
        for addr in (*addrs.steps, addrs.kv_link, addrs.dist_init):
            assert "@" not in addr and Path(addr.split("://", 1)[1]).parent == Path(addrs.dir), addr
        assert addrs.ifname == "lo"
    finally:
        addrs.remove_dir()
    assert not os.path.exists(addrs.dir)
    run = EngineIpcAddrs.new("pdserve_sec")  # an instance's engine: the ranks meet inside its directory,
    nested = TPAddrs.new(2, parent=run.dir)  # which the frontend removes even when the engine was killed
    assert Path(nested.dir).parent == Path(run.dir) and nested.kv_link.startswith(f"ipc://{run.dir}/")
    run.remove_files()
    assert not os.path.exists(nested.dir)


class LinkRig:
    """Rank 0's RankLink and a real rank-1 transfer agent on the kv_link of TPAddrs, with every
    post held (hold_file) so a report can only come from someone else."""

    def __init__(self, hold: Path) -> None:
        self.addrs = TPAddrs.new(2)
        self.ctx = zmq.Context()
        self.kv = torch.arange(2048, dtype=torch.float32)
        self.agent = RankAgent(RankAgentArgs(role="prefill", rank=1, link_addr=self.addrs.kv_link, kv_buffer=self.kv,
                                             kv_head_start=1, config=TransferConfig(faults=f"hold_file={hold}")))
        self.link = RankLink(self.addrs.kv_link, self.ctx)
        self.target_kv = torch.zeros(1024, dtype=torch.float32)
        self.target = NixlEndpoint("decode", [self.target_kv], None, FaultInjector(FaultSpec()))

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.target.progress()
            if self.link.sock.poll(5):
                self.link.on_readable()

    def close(self) -> None:
        self.agent.close()
        self.target.close()
        self.link.close()
        self.ctx.term()
        self.addrs.remove_dir()


@pytest.fixture
def link_rig(tmp_path: Path) -> Iterator[LinkRig]:
    (tmp_path / "hold").touch()
    rig = LinkRig(tmp_path / "hold")
    try:
        yield rig
    finally:
        rig.close()


def test_m5_a_forged_rank_report_or_hello_from_another_connection_is_dropped(link_rig: LinkRig,
                                                                              tmp_path: Path) -> None:
    rig = link_rig
    (hello,) = rig.link.wait_hellos(1, TIMEOUT_S)
    rig.link.add_peer([rig.target.metadata()])
    desc = np.array([[rig.kv.data_ptr(), 64, 0]], dtype=np.uint64)
    target = np.array([[rig.target_kv.data_ptr(), 64, 0]], dtype=np.uint64)
    xfer = rig.link.post_write(1, desc, target, "DRAM", rig.target.name, 64)
    forger = rig.ctx.socket(zmq.DEALER)  # same user, same path: the structural check still holds
    forger.setsockopt(zmq.LINGER, 0)
    forger.setsockopt(zmq.ROUTING_ID, b"2")
    forger.connect(rig.addrs.kv_link)
    try:
        forger.send(encode(RankDone(xfer.handle, True, ndescs=1, nbytes=64)))
        forger.send(encode(RankHello(1, "evil", b"", "DRAM", 0, 0, [0], 0)))
        forger.send(encode(RankHello(2, "evil", b"", "DRAM", 0, 0, [0], 0)))  # a rank 2 that does not exist
        wait_until(lambda: (rig.pump(0.05), rig.link.refused)[1] >= 2, TIMEOUT_S)
        rig.pump(0.2)
        assert rig.link.refused == 3
        assert not rig.link.is_done(xfer)  # the forged DONE did not complete rank 1's post
        assert rig.link.hellos == {1: hello} and rig.link.rank_stats()["rank1_descriptors"] == 0
        (tmp_path / "hold").unlink()  # rank 1's own report still counts
        assert wait_until(lambda: (rig.pump(0.05), rig.link.is_done(xfer))[1], TIMEOUT_S)
        assert torch.equal(rig.target_kv[:16], rig.kv[:16])
    finally:
        forger.close(0)


@pytest.fixture
def lab() -> Iterator[NetnsLab]:
    yield from lab_or_skip(1)


def test_m5_l10_a_tp_instance_meets_privately_and_listens_on_host(lab: NetnsLab, tiny_llama_path: str) -> None:
    """A TP 2 engine on --host = a lab address (its hostname resolves to 127.0.0.1 there): gloo's
    listeners of both ranks are on --host, the ranks' sockets are files no other user opens."""
    host = lab.addr(0)
    probe = ChildProcess(["ip", "netns", "exec", lab.namespace(host), sys.executable, "-m", "tests.security.tp_probe",
                          tiny_llama_path, host], "tp-probe")
    try:
        found: list[dict] = []

        def reported() -> bool:
            found[:] = [json.loads(ln) for ln in probe.log(None).splitlines() if ln.startswith("{")]
            return bool(found) or not probe.alive

        wait_until(reported, 180)
        assert found, probe.log()
        rep = found[0]
        assert rep["abstract"] == [] and rep["dir_mode"] == 0o700
        assert all(a.startswith(f"ipc://{rep['dir']}/") for a in [*rep["steps"], rep["kv_link"]])
        assert connect_as_nobody(rep["steps"][0].removeprefix("ipc://")) == "PermissionError"
        assert len(rep["listen"]) == 2 and all(ips == [host] for ips in rep["listen"].values()), rep["listen"]
        probe.stop(leftovers=False)  # rank 0 gone, rank 1 left running: it must notice and clean up
        assert wait_until(lambda: not os.path.exists(rep["dir"]), 15), os.listdir(rep["dir"])
    finally:
        probe.close()
