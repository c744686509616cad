"""A session's next turn waits (bounded) for the KV event of its last turn (issue 41, item 4).

A real publisher (the engine's) and the router's KVIndexes over ZMQ. The turn's pages reach
the publisher only after the wait began (the event "lost the race" with the client's next
turn): wait_for_page returns as soon as the index holds them, well inside its bound. A page
never published ends the wait at the bound; a worker not followed never waits.
"""

from __future__ import annotations

import asyncio
import random
import time

from common.cache import PageAllocator, RadixCache
from common.server.kv_event_publisher import KVEventPublisher
from router.breaker import CircuitBreaker
from router.kv_index import KVIndexes
from router.turn_events import PendingTurn, PendingTurns
from router.worker import CacheInfo, Worker

PAGE = 4
LATE_S = 0.05  # the event arrives this long after the next turn started waiting
BOUND_S = 2.0


def _insert(radix: RadixCache, tokens: list[int]) -> None:
    aligned = len(tokens) - len(tokens) % PAGE
    slots = radix.allocator.alloc_slots(0, None, aligned)
    assert slots is not None
    already = radix.insert(tokens[:aligned], slots)
    radix.allocator.free_slots(slots[:already])


async def _scenario() -> None:
    pub = KVEventPublisher("127.0.0.1", 0, PAGE, snapshot_interval_s=3600)
    radix = RadixCache(PageAllocator(64, PAGE), PAGE, events=pub)
    worker = Worker("http://decode", "decode", CircuitBreaker(1, 1, 1.0))
    worker.cache_info = CacheInfo(f"tcp://127.0.0.1:{pub.port}", 64)
    indexes = KVIndexes()
    try:
        indexes.sync([worker])
        clock = 0.0
        deadline = time.monotonic() + 10
        while indexes.index(worker.url) is None:  # a late joiner needs a snapshot
            assert time.monotonic() < deadline, "the router never synced"
            clock += 7200
            pub.flush(now=clock)
            await asyncio.sleep(0.05)
        turn = [random.Random(3).randrange(3, 300) for _ in range(23)]
        page = indexes.last_page_hash(worker.url, turn)
        assert page is not None
        pending = PendingTurns()
        pending.ended("chat-1", PendingTurn(worker.url, page))

        async def late_event() -> None:
            await asyncio.sleep(LATE_S)
            _insert(radix, turn)
            pub.flush(now=clock)

        publisher = asyncio.ensure_future(late_event())
        t0 = time.monotonic()
        owed = pending.take("chat-1")
        assert owed is not None and pending.take("chat-1") is None
        assert await indexes.wait_for_page(owed.decode_url, owed.page_hash, BOUND_S)
        took = time.monotonic() - t0
        assert LATE_S * 0.8 <= took < BOUND_S / 2, took
        await publisher
        assert indexes.cached_tokens(worker, turn, {}) == len(turn) - len(turn) % PAGE

        t0 = time.monotonic()
        assert not await indexes.wait_for_page(worker.url, page ^ 1, 0.2)  # never published: the bound
        assert time.monotonic() - t0 >= 0.2
        t0 = time.monotonic()
        assert not await indexes.wait_for_page("http://other", page, BOUND_S)  # not followed: no wait
        assert time.monotonic() - t0 < 0.1
    finally:
        await indexes.close()
        pub.close()


def test_next_turn_waits_for_its_last_turns_kv_event() -> None:
    asyncio.run(_scenario())
