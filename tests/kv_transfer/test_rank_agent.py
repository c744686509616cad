"""A TP rank's transfer agent against rank 0's link, in one process with real NIXL and ZMQ:
the agent registers its own slice only, writes what rank 0 hands it into a decode agent's
memory, and refuses descriptors outside its slice; rank-scoped fault injection."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
import zmq

from kv_transfer import FaultSpec, TransferConfig
from kv_transfer.endpoint import EndpointError, PostedXfer
from kv_transfer.faults import FaultInjector, InjectedFault
from kv_transfer.nixl_endpoint import NixlEndpoint
from kv_transfer.rank_agent import RankAgent, RankAgentArgs
from kv_transfer.rank_link import RankLink

LAYERS, NBYTES = 2, 4096
TIMEOUT_S = 10.0


class Rig:
    def __init__(self) -> None:
        self.ctx = zmq.Context()
        addr = f"ipc://@pdserve_test_{secrets.token_hex(4)}"
        self.kv = torch.arange(2 * LAYERS * NBYTES // 4, dtype=torch.float32)  # the rank's pool (any shape)
        self.agent = RankAgent(RankAgentArgs(role="prefill", rank=1, link_addr=addr, kv_buffer=self.kv,
                                             kv_head_start=1, config=TransferConfig(faults="rank=1,fail_post_nth=2")))
        self.link = RankLink(addr, self.ctx)
        self.target_kv = torch.zeros(NBYTES // 4, dtype=torch.float32)
        self.target = NixlEndpoint("decode", [self.target_kv], None, FaultInjector(FaultSpec()))

    def wait(self, xfer: PostedXfer) -> bool:
        """True when the rank reported the post DONE; raises its failure."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            self.target.progress()
            if self.link.sock.poll(5):
                self.link.on_readable()
            if self.link.is_done(xfer):
                return True
        raise AssertionError("the rank did not report its post")

    def close(self) -> None:
        self.agent.close()
        self.target.close()
        self.link.close()
        self.ctx.term()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    try:
        yield r
    finally:
        r.close()


def desc(addr: int, n: int) -> np.ndarray:
    return np.array([[addr, n, 0]], dtype=np.uint64)


def test_rank_agent_registers_its_slice_and_writes_for_rank_0(rig: Rig) -> None:
    (hello,) = rig.link.wait_hellos(1, TIMEOUT_S)
    assert hello.rank == 1 and hello.head_start == 1
    assert hello.bases == [rig.kv.data_ptr()]
    assert hello.registered_bytes == 2 * LAYERS * NBYTES  # its KV pool, nothing else
    rig.link.add_peer([rig.target.metadata()])
    half = NBYTES // 2
    src = rig.kv.data_ptr() + 3 * NBYTES + half
    xfer = rig.link.post_write(1, desc(src, half), desc(rig.target_kv.data_ptr(), half), "DRAM", rig.target.name, half)
    assert xfer.rank == 1 and rig.wait(xfer)
    assert torch.equal(rig.target_kv[: half // 4], rig.kv[(3 * NBYTES + half) // 4 :])
    assert rig.link.rank_stats() == {"rank1_registered_bytes": 2 * LAYERS * NBYTES, "rank1_descriptors": 1,
                                     "rank1_bytes": half, "rank1_failed_posts": 0}
    # the 2nd post fails (fault key rank=1): reported, and terminal (nothing of it lands later)
    xfer = rig.link.post_write(1, desc(rig.kv.data_ptr(), 8), desc(rig.target_kv.data_ptr(), 8), "DRAM",
                               rig.target.name, 8)
    with pytest.raises(EndpointError, match="injected") as failed:
        rig.wait(xfer)
    assert failed.value.injected and failed.value.terminal
    # memory outside this rank's slice (another rank's heads, or anything else) is never posted
    outside = torch.zeros(64)
    xfer = rig.link.post_write(1, desc(outside.data_ptr(), 64), desc(rig.target_kv.data_ptr(), 64), "DRAM",
                               rig.target.name, 64)
    with pytest.raises(EndpointError, match="outside its KV slice"):
        rig.wait(xfer)
    assert rig.link.rank_stats()["rank1_failed_posts"] == 2


def test_fault_key_rank_picks_the_agent() -> None:
    spec = FaultSpec.parse("rank=1,fail_post_nth=1")
    FaultInjector(spec, rank=0).before_post()  # rank 0's manager is not hit
    with pytest.raises(InjectedFault):
        FaultInjector(spec, rank=1).before_post()
    assert spec.active and not FaultSpec.parse("rank=1").active
