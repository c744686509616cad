"""EngineStats in process (the real path is tests/security/test_metrics_scrape.py): one StatsReq in
flight shared by every caller, the last answer only while nothing moved, a lost request resent,
and waiters failed at once when the engine dies."""

from __future__ import annotations

import asyncio

import pytest

from common.server import engine_stats as es
from common.server.engine_stats import EngineStats, StatsUnavailable


class _Engine:
    """Records StatsReq seqs; `steps` is what the step clock would say."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.steps = 0
        self.accepting = True

    def send(self, seq: int) -> bool:
        if self.accepting:
            self.sent.append(seq)
        return self.accepting


def _make() -> tuple[_Engine, EngineStats]:
    eng = _Engine()
    return eng, EngineStats(eng.send, lambda: eng.steps)


def test_callers_share_one_request_and_fresh_callers_wait_for_the_next() -> None:
    async def main() -> None:
        eng, stats = _make()
        first = [asyncio.ensure_future(stats.fetch(5.0)) for _ in range(50)]
        await asyncio.sleep(0)
        assert eng.sent == [1]
        stats.activity += 1  # a request moved: callers from now on need a newer answer
        late = asyncio.ensure_future(stats.fetch(5.0))
        await asyncio.sleep(0)
        assert eng.sent == [1], "a second StatsReq while one is in flight"
        stats.answered(1, {"x": 1.0})
        assert await asyncio.gather(*first) == [{"x": 1.0}] * 50
        await asyncio.sleep(0)
        assert eng.sent == [1, 2] and not late.done()
        stats.answered(2, {"x": 2.0})
        assert await late == {"x": 2.0}

    asyncio.run(main())


def test_the_last_answer_serves_while_nothing_moved_and_is_young() -> None:
    async def main() -> None:
        eng, stats = _make()
        task = asyncio.ensure_future(stats.fetch(5.0, max_age_s=60))
        await asyncio.sleep(0)
        stats.answered(1, {"x": 1.0})
        assert await task == {"x": 1.0}
        for _ in range(100):
            assert await stats.fetch(5.0, max_age_s=60) == {"x": 1.0}
        assert eng.sent == [1]
        eng.steps += 1  # the engine stepped: the cached answer may be stale
        task = asyncio.ensure_future(stats.fetch(5.0, max_age_s=60))
        await asyncio.sleep(0)
        assert eng.sent == [1, 2]
        stats.answered(2, {"x": 2.0})
        assert await task == {"x": 2.0}
        task = asyncio.ensure_future(stats.fetch(5.0))  # no max_age: always a request of its own time
        await asyncio.sleep(0)
        assert eng.sent == [1, 2, 3]
        stats.answered(3, {"x": 3.0})
        assert await task == {"x": 3.0}

    asyncio.run(main())


def test_timeouts_resend_and_engine_death(monkeypatch: pytest.MonkeyPatch) -> None:
    async def main() -> None:
        eng, stats = _make()
        with pytest.raises(StatsUnavailable, match="within"):
            await stats.fetch(0.01)
        with pytest.raises(StatsUnavailable, match="within"):
            await stats.fetch(0.01)
        assert eng.sent == [1], "a timed-out waiter must not trigger another StatsReq while one is in flight"
        monkeypatch.setattr(es, "RESEND_AFTER_S", 0.0)  # the first one is given up on: lost
        stats.refresh()
        assert eng.sent == [1, 2]
        monkeypatch.setattr(es, "RESEND_AFTER_S", 10.0)
        waiter = asyncio.ensure_future(stats.fetch(5.0))
        await asyncio.sleep(0)
        stats.fail("the engine process died")
        with pytest.raises(StatsUnavailable, match="died"):
            await waiter
        eng.accepting = False
        with pytest.raises(StatsUnavailable, match="not taking"):
            await stats.fetch(1.0)

    asyncio.run(main())
