"""HeapTrimmer: malloc_trim once per idle spell, at most every interval, never when off."""

from __future__ import annotations

import pytest

from common.server.heap_trim import HeapTrimmer, load_malloc_trim


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(interval: float) -> tuple[HeapTrimmer, list[int], FakeClock]:
    calls: list[int] = []
    clock = FakeClock()
    return HeapTrimmer(interval, trim=lambda pad: calls.append(pad) or 0, clock=clock), calls, clock


def test_trims_once_per_idle_spell_after_work() -> None:
    t, calls, clock = make(10.0)
    assert not t.idle()  # no work yet: nothing to give back
    t.busy()
    assert t.idle() and calls == [0]
    assert not t.idle()  # same idle spell
    t.busy()
    clock.now += 5.0
    assert not t.idle()  # within the interval
    clock.now += 5.0
    assert t.idle() and t.trims == 2  # the work before still counts


def test_zero_interval_never_trims() -> None:
    t, calls, _ = make(0.0)
    t.busy()
    assert not t.enabled and not t.idle() and calls == []


def test_glibc_malloc_trim_runs() -> None:
    trim = load_malloc_trim()
    if trim is not None:  # glibc: the real call returns 0 or 1
        assert trim(0) in (0, 1)


def test_the_engine_loop_trims_once_after_a_request(tiny_llama_path: str) -> None:
    """EngineCore.run_iteration wires the trimmer (built from --malloc-trim-interval): the
    iterations of a request count as work, and the idle spell after it trims once."""
    from common.engine import Engine
    from common.sampling_params import SamplingParams
    from common.scheduler.req import Req

    engine = Engine(tiny_llama_path, dtype="float32", page_size=4, max_total_tokens=256, malloc_trim_interval=10.0)
    try:
        trimmer = engine.core.heap_trimmer
        if not trimmer.enabled:
            pytest.skip("no glibc malloc_trim in this C library")
        engine.scheduler.add_request(Req(rid="r", origin_input_ids=[5, 6, 7],
                                         sampling_params=SamplingParams(max_new_tokens=1), stream=True,
                                         eos_token_ids=frozenset()))
        for _ in range(10):
            engine.core.run_iteration()
        assert not engine.scheduler.has_work
        assert trimmer.trims == 1  # once for the spell, not once per idle iteration
        engine.check_integrity()
    finally:
        engine.shutdown()
