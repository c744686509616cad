"""HeapTrimmer: malloc_trim once per idle spell, at most every interval, never when off."""

from __future__ import annotations

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
