from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.cache import PageAllocator, PoolInvariantError


def test_manages_pages_1_to_n_minus_1() -> None:
    alloc = PageAllocator(num_pages=9, page_size=4)
    assert (alloc.num_usable, alloc.num_free, alloc.page_size) == (8, 8, 4)
    pages = alloc.alloc(8)
    assert pages is not None and sorted(pages) == list(range(1, 9))
    assert alloc.num_free == 0 and alloc.num_allocated == 8
    assert alloc.alloc(1) is None
    alloc.check_integrity()


def test_round_trip_and_reuse() -> None:
    alloc = PageAllocator(num_pages=11, page_size=1)
    a, b = alloc.alloc(3), alloc.alloc(4)
    assert a is not None and b is not None and not set(a) & set(b)
    alloc.free(a)
    assert alloc.num_free == 6
    c = alloc.alloc(6)
    assert c is not None and set(c) == set(range(1, 11)) - set(b)
    alloc.free(b)
    alloc.free(iter(c))
    assert alloc.num_free == 10
    assert alloc.alloc(0) == []
    alloc.check_integrity()


def test_pages_come_out_in_ascending_runs_after_interleaved_frees() -> None:
    """Two requests growing one page per step interleave their pages; once both are freed (in
    any order) a new request still gets one ascending run: a KV transfer moves it as ONE descriptor."""
    alloc = PageAllocator(num_pages=33, page_size=1)
    a, b = [], []
    for _ in range(16):
        a += alloc.alloc(1) or []
        b += alloc.alloc(1) or []
    assert a == list(range(1, 33, 2)) and alloc.num_free == 0
    rng = random.Random(5)
    rng.shuffle(a)
    alloc.free(b)
    alloc.free(a)
    assert alloc.alloc(32) == list(range(1, 33))
    alloc.check_integrity()
    alloc.free(range(1, 33))
    assert alloc.alloc(3) == [1, 2, 3] and alloc.num_free == 29
    alloc.check_integrity()


def test_all_or_nothing() -> None:
    alloc = PageAllocator(num_pages=5, page_size=2)
    assert alloc.alloc(5) is None
    assert alloc.num_free == 4
    assert alloc.alloc_slots(0, None, 9) is None  # needs 5 pages
    assert alloc.num_free == 4
    assert alloc.alloc_slots(1, 2, 10) is None  # 1 continued slot + 9 fresh slots = 5 pages
    assert alloc.num_free == 4
    alloc.check_integrity()


@pytest.mark.parametrize("bad", [[0], [5], [-1], [2, 2]])
def test_bad_free_raises_and_frees_nothing(bad: list[int]) -> None:
    alloc = PageAllocator(num_pages=5, page_size=1)
    pages = alloc.alloc(4)
    assert pages is not None
    with pytest.raises(PoolInvariantError):
        alloc.free(bad)
    assert alloc.num_free == 0
    alloc.check_integrity()


def test_double_free_raises() -> None:
    alloc = PageAllocator(num_pages=5, page_size=1)
    pages = alloc.alloc(2)
    assert pages is not None
    alloc.free(pages)
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(pages[:1])
    alloc.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_slots_from_empty(page_size: int) -> None:
    alloc = PageAllocator(num_pages=64, page_size=page_size)
    n = 2 * page_size + 1
    slots = alloc.alloc_slots(0, None, n)
    assert slots is not None and len(slots) == n
    assert alloc.num_free == 63 - 3
    for i in range(0, n, page_size):  # each page's slots are one contiguous, aligned run
        run = slots[i : i + page_size]
        assert run[0] % page_size == 0 and run == list(range(run[0], run[0] + len(run)))
    assert len(set(s // page_size for s in slots)) == 3


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_slots_continues_partial_page(page_size: int) -> None:
    alloc = PageAllocator(num_pages=64, page_size=page_size)
    seq = alloc.alloc_slots(0, None, page_size + 1)  # one full page + one token on a second page
    assert seq is not None
    free_before = alloc.num_free
    room = (-len(seq)) % page_size
    assert room == (page_size - 1 if page_size > 1 else 0)
    more = alloc.alloc_slots(len(seq), seq[-1], room)  # fits entirely in the partial page
    assert more == list(range(seq[-1] + 1, seq[-1] + 1 + room))
    assert alloc.num_free == free_before
    seq += more
    extra = alloc.alloc_slots(len(seq), seq[-1], 1)  # now page aligned: needs a fresh page
    assert extra is not None and extra[0] % page_size == 0
    assert alloc.num_free == free_before - 1
    seq += extra
    assert len(set(seq)) == len(seq)
    alloc.free(alloc.pages_of(seq))
    assert alloc.num_free == 63
    alloc.check_integrity()


def test_alloc_slots_diagram_example() -> None:
    alloc = PageAllocator(num_pages=16, page_size=4)
    held = alloc.alloc(7)  # pages 1..7 taken; page 7 holds t4, t5 at slots 28, 29
    assert held == list(range(1, 8))
    slots = alloc.alloc_slots(6, 29, 7)
    assert slots == [30, 31, 32, 33, 34, 35, 36]  # continued 30, 31; new pages 8 and 9
    assert alloc.num_free == 15 - 9


def test_alloc_slots_rejects_inconsistent_last_slot() -> None:
    alloc = PageAllocator(num_pages=16, page_size=4)
    with pytest.raises(PoolInvariantError):
        alloc.alloc_slots(6, 30, 1)  # token 5 must sit at offset 1, not 2
    with pytest.raises(PoolInvariantError):
        alloc.alloc_slots(6, None, 1)


def test_pages_of_and_free_slots() -> None:
    alloc = PageAllocator(num_pages=16, page_size=4)
    slots = alloc.alloc_slots(0, None, 10)
    assert slots is not None
    pages = alloc.pages_of(slots)
    assert pages == [slots[0] // 4, slots[4] // 4, slots[8] // 4]
    with pytest.raises(PoolInvariantError):
        alloc.pages_of(slots[1:])
    alloc.free_slots(slots)
    assert alloc.num_free == 15
    alloc.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    alloc = PageAllocator(num_pages=8, page_size=1)
    alloc.alloc(2)
    alloc._is_free[1] = 1  # corrupt: an allocated page flagged free
    with pytest.raises(PoolInvariantError):
        alloc.check_integrity()
    alloc._is_free[1] = 0
    alloc.check_integrity()
    alloc._len[3] = 1  # corrupt: a second run inside the free run 3..7
    with pytest.raises(PoolInvariantError):
        alloc.check_integrity()


def test_rejects_too_small_pool() -> None:
    with pytest.raises(ValueError):
        PageAllocator(num_pages=1, page_size=4)


def _runs(pages: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in zip(pages, pages[1:], strict=False))


def churn(alloc: PageAllocator, seed: int, rounds: int = 400, reserve: int = 40) -> list[list[int]]:
    """Requests of 1-40 pages come and go in random order (keeping `reserve` pages free), until
    about half the pool is held."""
    rng = random.Random(seed)
    held: list[list[int]] = []
    for _ in range(rounds):
        if held and (rng.random() < 0.45 or alloc.num_free < reserve):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(alloc.alloc(rng.randint(1, 40)) or [])
    return held


@pytest.mark.parametrize("seed", range(5))
def test_a_request_gets_few_runs_after_churn(seed: int) -> None:
    """A 64-page request (1,024 tokens at page 16) on a churned pool is one run when any free run
    holds 64 pages, and never more runs than a largest-first pick needs."""
    alloc = PageAllocator(num_pages=2049, page_size=16)
    churn(alloc, seed)
    assert alloc.num_runs > 10  # the pool really is fragmented
    largest = max(alloc._len.values())
    pages = alloc.alloc(64)
    assert pages is not None and len(set(pages)) == 64
    assert _runs(pages) == 1 if largest >= 64 else _runs(pages) <= 4
    alloc.check_integrity()


def test_alloc_continues_after_the_callers_last_page() -> None:
    alloc = PageAllocator(num_pages=64, page_size=4)
    a = alloc.alloc(4)
    b = alloc.alloc(4)
    assert a == [1, 2, 3, 4] and b == [5, 6, 7, 8]
    alloc.free([6, 7, 8])  # run 6..63
    assert alloc.alloc(2, after=5) == [6, 7]  # the next chunk right after the request's pages
    slots = alloc.alloc_slots(4 * 3, 4 * 7 + 3, 8)  # continue a 12-token sequence ending in page 7
    assert slots is not None and [s // 4 for s in slots[::4]] == [8, 9]
    alloc.check_integrity()


def test_fewest_runs_when_no_run_fits() -> None:
    alloc = PageAllocator(num_pages=41, page_size=1)
    pages = alloc.alloc(40)
    assert pages == list(range(1, 41))
    alloc.free([*range(1, 5), *range(10, 20), *range(25, 33), 40])  # free runs of 4, 10, 8, 1
    got = alloc.alloc(17)
    assert got is not None and _runs(got) == 2 and set(got) <= set(range(10, 33))  # the two largest
    alloc.check_integrity()


@given(st.lists(st.tuples(st.booleans(), st.integers(1, 12), st.integers(0, 1000)), max_size=120))
@settings(max_examples=150, deadline=None)
def test_random_alloc_free_keeps_the_runs_consistent(ops: list[tuple[bool, int, int]]) -> None:
    alloc = PageAllocator(num_pages=65, page_size=1)
    held: list[list[int]] = []
    for is_alloc, n, pick in ops:
        if is_alloc or not held:
            after = held[pick % len(held)][-1] if held and pick % 2 else None
            got = alloc.alloc(n, after=after)
            if got is None:
                assert n > alloc.num_free
            else:
                assert len(got) == len(set(got)) == n and all(not alloc.is_free(p) for p in got)
                held.append(got)
        else:
            alloc.free(held.pop(pick % len(held)))
        alloc.check_integrity()
        assert alloc.num_free + sum(map(len, held)) == alloc.num_usable
