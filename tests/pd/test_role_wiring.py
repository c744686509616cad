"""Each role's wiring, built by its real RoleSpec: decode frees pages only after the step in
flight and keeps no prefix cache; prefill keeps its cache. In-process engines (tiny model,
fp32) joined by real KVManagers, stepped by the test (tests/pd/inproc.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from common.scheduler.messages import FinishReason
from tests.engine.reference import hf_greedy
from tests.pd.inproc import InProcessPD


@pytest.fixture
def overlap_pd(tiny_llama_path: str) -> Iterator[InProcessPD]:
    # Decode: the overlap loop (forced on CPU) and a pool of 8 usable pages of 4 tokens, so a
    # request admitted right after another finished can only get pages the finished one held.
    pd = InProcessPD(tiny_llama_path, decode_args={"enable_cpu_overlap_schedule": True, "max_total_tokens": 32,
                                                   "num_reserved_decode_tokens": 4})
    try:
        yield pd
    finally:
        pd.close()


def test_roles_are_wired_as_specified(tiny_llama_path: str) -> None:
    pd = InProcessPD(tiny_llama_path)
    try:
        decode, prefill = pd.decode, pd.prefill
        assert decode.role.name == "decode" and decode.scheduler.kv.defer_frees
        assert decode.scheduler.kv.radix.disable and decode.ready_stats()["radix_cache_enabled"] == 0.0
        assert decode.scheduler.cfg.schedule_policy == "fcfs"  # lpm needs the radix cache
        assert prefill.role.name == "prefill" and not prefill.scheduler.kv.defer_frees
        assert not prefill.scheduler.kv.radix.disable and prefill.ready_stats()["radix_cache_enabled"] == 1.0
        assert prefill.ready_stats()["bootstrap_port"] == float(pd.bootstrap_port)
    finally:
        pd.close()


def test_decode_never_frees_pages_the_step_in_flight_writes(overlap_pd: InProcessPD, tiny_llama_path: str) -> None:
    pd = overlap_pd
    sched = pd.decode.scheduler
    allocator = sched.kv.allocator
    ps = allocator.page_size
    violations: list[str] = []
    real_free = allocator.free

    def checked_free(pages):  # type: ignore[no-untyped-def]
        pages = list(pages)
        if sched.in_flight is not None:
            written = {slot // ps for slot in sched.in_flight.batch.worker_batch.out_cache_loc}
            if written & set(pages):
                violations.append(f"pages {sorted(written & set(pages))} freed while the step writing them runs")
        real_free(pages)

    allocator.free = checked_free  # type: ignore[method-assign]

    prompt_a = [5 + (7 * i) % 300 for i in range(12)]
    prompt_b = [11 + (13 * i) % 300 for i in range(16)]
    ref_a = hf_greedy(tiny_llama_path, prompt_a, 20)
    stop_at = next(i for i in range(3, 20) if ref_a[i] not in ref_a[:i])  # first occurrence: stops exactly there
    pd.submit("a", prompt_a, 20, stop_token_ids=[ref_a[stop_at]])

    pages_of_a: set[int] = set()
    b_submitted = False
    admitted_b_in_flight: list[bool] = []
    pages_of_b: set[int] = set()
    deadline = time.monotonic() + 60.0  # transfers complete on the managers' threads: bound by time
    while time.monotonic() < deadline:
        req_a = sched.reqs.get("a")
        if req_a is not None and req_a.kv_slots:
            pages_of_a |= {s // ps for s in req_a.kv_slots}
        if not b_submitted and req_a is not None and len(req_a.output_ids) >= 2:
            pd.submit("b", prompt_b, 6)  # waits in decode's prealloc queue: memory is short
            b_submitted = True
        waiting_b = [r for r in sched.prealloc if r.rid == "b"]
        pd.pump()
        if waiting_b and waiting_b[0] in sched.transferring:
            admitted_b_in_flight.append(sched.in_flight is not None)
            pages_of_b = {s // ps for s in waiting_b[0].kv_slots}
        if pd.decode_out.finished("a") and pd.decode_out.finished("b"):
            break

    assert pd.decode_out.outputs["a"][-1].finish_reason == FinishReason("stop", matched_token=ref_a[stop_at])
    assert pd.tokens("a") == ref_a[: stop_at + 1]
    assert pd.tokens("b") == hf_greedy(tiny_llama_path, prompt_b, 6)
    assert admitted_b_in_flight == [False] or admitted_b_in_flight == [True], admitted_b_in_flight
    assert pages_of_b & pages_of_a, "the scenario must make b reuse a's pages (pool too large?)"
    assert not violations, violations
