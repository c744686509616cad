"""Pure parts: descriptor coalescing (hypothesis), aux rows and slots, config, faults,
poll-state rules, wire messages, handle argument checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.cache.kv_pool import PAGE_MAJOR
from kv_transfer import (
    AuxBuffer,
    AuxRow,
    AuxSlotAllocator,
    FailureCause,
    FaultSpec,
    KVPoll,
    KVTransferError,
    TransferConfig,
    min_poll,
)
from kv_transfer.aux_buffer import ROW_BYTES
from kv_transfer.aux_format import MAX_TOP_LOGPROBS
from kv_transfer.base import StateCell
from kv_transfer.descriptors import build_descs, coalesce_pages, coalesce_runs
from kv_transfer.faults import FaultInjector, InjectedFault
from kv_transfer.handles import KVReceiver, KVSender
from kv_transfer.messages import Register, Status, WireLayout, decode, encode

PAGE = 48


@st.composite
def page_pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    n = draw(st.integers(0, 40))
    # runs of consecutive pages mixed with random jumps, on both sides
    src = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    dst = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    for side in (src, dst):
        for i in range(1, n):
            if draw(st.booleans()):
                side[i] = side[i - 1] + 1
    return src, dst


@given(page_pairs())
@settings(max_examples=300, deadline=None)
def test_coalesce_runs_cover_exactly_and_are_maximal(pair: tuple[list[int], list[int]]) -> None:
    src, dst = pair
    runs = coalesce_runs(src, dst, PAGE)
    expanded = [(r.src_offset + k * PAGE, r.dst_offset + k * PAGE) for r in runs for k in range(r.length // PAGE)]
    assert expanded == [(s * PAGE, d * PAGE) for s, d in zip(src, dst, strict=True)]
    assert all(r.length > 0 and r.length % PAGE == 0 for r in runs)
    for a, b in zip(runs, runs[1:], strict=False):  # no two neighbours could have merged
        assert not (b.src_offset == a.src_offset + a.length and b.dst_offset == a.dst_offset + a.length)


def test_coalesce_examples() -> None:
    runs = coalesce_pages([7, 8, 9, 3, 4, 5], [1, 2, 3, 9, 4, 5])
    assert list(zip(runs.src_start, runs.dst_start, runs.num_pages, strict=True)) == [(7, 1, 3), (3, 9, 1), (4, 4, 2)]
    assert coalesce_runs([], [], PAGE) == []
    with pytest.raises(ValueError):
        coalesce_pages([1, 2], [1])


def test_build_descs_one_per_buffer_and_run() -> None:
    runs = coalesce_pages([2, 3, 9], [5, 6, 1])
    d = build_descs(runs, PAGE, [1000, 50000], [7000, 90000], 0, 3)
    assert d.local.shape == (4, 3) and d.nbytes == 3 * PAGE * 2
    assert d.local[:, 0].tolist() == [1000 + 2 * PAGE, 1000 + 9 * PAGE, 50000 + 2 * PAGE, 50000 + 9 * PAGE]
    assert d.remote[:, 0].tolist() == [7000 + 5 * PAGE, 7000 + 1 * PAGE, 90000 + 5 * PAGE, 90000 + 1 * PAGE]
    assert d.local[:, 1].tolist() == [2 * PAGE, PAGE, 2 * PAGE, PAGE] and set(d.remote[:, 2].tolist()) == {3}


def test_aux_rows_and_slots() -> None:
    aux = AuxBuffer(4)
    assert aux.tensor.shape == (4, ROW_BYTES) and ROW_BYTES % 64 == 0 and aux.read_row(2) is None
    aux.write_row(2, AuxRow(first_token=17, cached_tokens=3, logprob=-1.5, room=2**63 - 1))
    assert aux.read_row(2) == AuxRow(17, 3, -1.5, 2**63 - 1)
    top = tuple((t, -0.25 * t) for t in range(MAX_TOP_LOGPROBS))  # the first token's top k, all of it
    aux.write_row(3, AuxRow(first_token=0, logprob=-0.0, room=9, top_logprobs=top))
    assert aux.read_row(3) == AuxRow(0, 0, -0.0, 9, top)
    with pytest.raises(ValueError, match="do not fit"):
        aux.write_row(3, AuxRow(first_token=0, top_logprobs=((1, -1.0),) * (MAX_TOP_LOGPROBS + 1)))
    aux.write_row(1, AuxRow(first_token=5))
    assert aux.read_row(1) == AuxRow(5, 0, None, 0)
    aux.clear_row(2)
    assert aux.read_row(2) is None
    with pytest.raises(IndexError):
        aux.read_row(4)
    slots = AuxSlotAllocator(2)
    a, b = slots.alloc(), slots.alloc()
    assert {a, b} == {0, 1} and slots.alloc() is None
    slots.check_integrity()
    slots.free(a)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        slots.free(a)  # type: ignore[arg-type]
    slots.check_integrity()
    slots._used.add(7)
    with pytest.raises(AssertionError):
        slots.check_integrity()


def test_config_and_fault_spec() -> None:
    with pytest.raises(ValueError):
        TransferConfig(transfer_timeout_s=0)
    with pytest.raises(ValueError):
        TransferConfig(heartbeat_interval_s=2, heartbeat_timeout_s=1)
    spec = FaultSpec.parse("fail_post=0.1,fail_poll=0.05,drop_status=0.1,delay_ms=50,seed=1")
    assert spec == FaultSpec(fail_post=0.1, fail_poll=0.05, drop_status=0.1, delay_ms=50, seed=1) and spec.active
    assert not FaultSpec.parse("").active
    for bad in ("nope=1", "fail_post", "fail_post=x"):
        with pytest.raises(ValueError):
            FaultSpec.parse(bad)
    inj = FaultInjector(FaultSpec.parse("fail_post_nth=2,drop_status_nth=1"))
    inj.before_post()
    with pytest.raises(InjectedFault):
        inj.before_post()
    assert inj.drop_status() and not inj.drop_status()
    assert inj.injected == {"fail_post": 1, "drop_status": 1}


def test_fault_hold_file_stalls_completion_while_it_exists(tmp_path: Path) -> None:
    hold = tmp_path / "hold"
    spec = FaultSpec.parse(f"delay_ms=5, hold_file={hold}")
    assert spec == FaultSpec(delay_ms=5, hold_file=str(hold)) and spec.active
    inj = FaultInjector(spec)
    assert not inj.holding()
    hold.touch()
    assert inj.holding() and inj.holding()
    hold.unlink()
    assert not inj.holding() and inj.injected == {"hold": 2}


def test_state_cell_rules() -> None:
    assert min_poll([KVPoll.Success, KVPoll.Transferring, KVPoll.WaitingForInput]) == KVPoll.WaitingForInput
    cell = StateCell()
    assert cell.advance(KVPoll.Transferring) and not cell.advance(KVPoll.WaitingForInput)
    assert cell.fail(FailureCause.ABORTED, "x") and not cell.fail(FailureCause.PEER_LOST, "y")
    assert cell.state == KVPoll.Failed and cell.reason == "x" and not cell.advance(KVPoll.Success)
    done = StateCell()
    done.advance(KVPoll.Success)
    assert not done.fail(FailureCause.ABORTED, "late") and done.state == KVPoll.Success


def test_wire_messages_round_trip() -> None:
    reg = Register(1, "d", b"\x00md", WireLayout(2, 8, 4, 2, 8, "bfloat16", PAGE_MAJOR), [1], "DRAM", 0, 99, 64, 8, b"tok")
    assert decode(encode(reg)) == reg
    st_ = Status(2**63 - 1, False, "why", "aborted", reregister=True)
    assert decode(encode(st_)) == st_


def test_handles_reject_misuse() -> None:
    cmds: list[object] = []

    def fail(cell: StateCell, cause: FailureCause, reason: str) -> bool:
        return cell.fail(cause, reason)

    with pytest.raises(KVTransferError):
        KVSender("r", -1, cmds.append, fail)
    s = KVSender("r", 5, cmds.append, fail)
    with pytest.raises(KVTransferError, match="before WaitingForInput"):
        s.send([1], is_last=True, aux=AuxRow(1))
    s.num_dst_pages = 3
    s.cell.advance(KVPoll.WaitingForInput)
    with pytest.raises(KVTransferError, match="decode allocated 3"):
        s.send([1, 2, 3, 4], is_last=False)
    with pytest.raises(KVTransferError, match="last send ends"):
        s.send([1], is_last=True, aux=AuxRow(1))
    with pytest.raises(KVTransferError, match="aux row"):
        s.send([1, 2, 3], is_last=True)
    s.send([1, 2], is_last=False)
    assert s.poll() == KVPoll.Transferring
    s.send([3], is_last=True, aux=AuxRow(1))
    with pytest.raises(KVTransferError, match="after the last"):
        s.send([4], is_last=True, aux=AuxRow(1))
    r = KVReceiver("r", 5, "h", 1, AuxBuffer(2), 16, cmds.append, fail)
    for pages, slot in (([], 0), ([1, 16], 0), ([1, 1], 0), ([1], 2)):
        with pytest.raises(KVTransferError):
            r.init(pages, slot)
    assert r.pages_releasable()
    r.init(np.array([3, 4]), 1)
    assert r.poll() == KVPoll.Transferring and not r.pages_releasable()
    with pytest.raises(KVTransferError, match="twice"):
        r.init([5], 1)
    r.abort("bye")
    assert r.poll() == KVPoll.Failed and r.failure_cause == FailureCause.ABORTED and not r.pages_releasable()


def test_gbps_comes_from_post_to_done_not_room_latency() -> None:
    from prometheus_client import generate_latest

    from kv_transfer.metrics import TransferMetrics

    m = TransferMetrics("prefill")
    m.posted(2_000_000_000, 3)
    m.handle_done(2_000_000_000, post_s=0.001, wire_s=0.5)  # KV: 4 GB/s on the wire
    m.handle_done(64, post_s=0.001, wire_s=0.25, kv=False)  # the aux row: timed, not in GB/s
    m.completed(2_000_000_064, latency_s=4.0, ndescs=3)  # the room took 4 s (compute between chunks)
    s = m.stats()
    assert s["gbps"] == pytest.approx(4.0) and s["latency_gbps"] == pytest.approx(0.5, rel=1e-6)
    assert s["wire_seconds"] == 0.5 and s["post_seconds"] == pytest.approx(0.002) and s["handles"] == 2
    text = generate_latest(m.registry).decode()
    for name in ("kv_transfer_post_seconds_count", "kv_transfer_wire_seconds_count", "kv_transfer_wire_gbps_count",
                 "kv_transfer_request_descriptors_sum"):
        assert f'{name}{{phase="prefill"}}' in text, name
    assert 'kv_transfer_wire_gbps_count{phase="prefill"} 1.0' in text
