from __future__ import annotations

import numpy as np
import pytest

from common.cache import PageAllocator, PoolInvariantError, RadixCache, check_pool_integrity


def make(page_size: int, num_pages: int = 64, *, disable: bool = False) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages, page_size)
    return alloc, RadixCache(alloc, page_size, disable=disable)


def run_request(alloc: PageAllocator, radix: RadixCache, tokens: list[int]) -> list[int]:
    """What the scheduler does for one finished request: match, lock, compute, insert, free, unlock."""
    prefix, node = radix.match_prefix(tokens)
    radix.inc_lock_ref(node)
    own = alloc.alloc_slots(len(prefix), prefix[-1] if prefix else None, len(tokens) - len(prefix))
    assert own is not None
    slots = prefix + own
    already = radix.insert(tokens, slots)
    assert already >= len(prefix)
    aligned = len(tokens) - len(tokens) % radix.page_size
    alloc.free_slots(slots[len(prefix) : already])
    alloc.free_slots(slots[aligned:])
    radix.dec_lock_ref(node)
    check_pool_integrity(alloc, radix, in_use_pages=0)
    return slots


def test_page1_match_insert_split() -> None:
    alloc, radix = make(page_size=1)
    slots = run_request(alloc, radix, [1, 2, 3, 4])
    assert radix.cached_pages == 4 and radix.num_nodes == 1
    assert radix.match_prefix([1, 2, 3, 4, 5]).slots == slots
    assert radix.match_prefix([1, 2, 3, 4]).slots == slots[:3]  # never the last token
    assert radix.num_nodes == 2  # the match split [1, 2, 3, 4] into [1, 2, 3] -> [4]
    assert radix.match_prefix([1]).slots == []
    assert radix.match_prefix([]).slots == []
    res = radix.match_prefix([1, 2, 9, 9])
    assert res.slots == slots[:2] and res.last_node.key.tolist() == [1, 2]
    assert radix.num_nodes == 3  # [1, 2] -> [3] -> [4]
    assert radix.match_prefix([7, 1, 2]).last_node is radix.root
    check_pool_integrity(alloc, radix, in_use_pages=0)


def test_page16_match_is_page_aligned() -> None:
    alloc, radix = make(page_size=16)
    tokens = list(range(100, 140))  # 40 tokens: 2 whole pages + 8 tail tokens
    slots = run_request(alloc, radix, tokens)
    assert radix.cached_pages == 2 and alloc.num_free == 63 - 2
    assert radix.match_prefix(tokens).slots == slots[:32]
    assert radix.match_prefix(tokens[:33]).slots == slots[:32]
    assert radix.match_prefix(tokens[:32]).slots == slots[:16]  # 31 tokens round down to one page
    assert radix.match_prefix(tokens[:16]).slots == []
    diverged = tokens[:20] + [0] * 20
    res = radix.match_prefix(diverged)
    assert res.slots == slots[:16] and len(res.last_node.key) == 16
    assert radix.num_nodes == 2
    check_pool_integrity(alloc, radix, in_use_pages=0)


@pytest.mark.parametrize("page_size", [1, 16])
def test_duplicate_insert_returns_cached_len(page_size: int) -> None:
    alloc, radix = make(page_size)
    tokens = list(range(1, 3 * page_size + 1))
    first = run_request(alloc, radix, tokens)
    other = alloc.alloc_slots(0, None, len(tokens))  # a request that did not use the cache
    assert other is not None
    assert radix.insert(tokens, other) == len(tokens)
    alloc.free_slots(other)
    longer = tokens + list(range(500, 500 + 2 * page_size))
    slots2 = alloc.alloc_slots(0, None, len(longer))
    assert slots2 is not None
    assert radix.insert(longer, slots2) == len(tokens)
    alloc.free_slots(slots2[: len(tokens)])
    assert radix.match_prefix(longer + [0]).slots == first + slots2[len(tokens) :]
    assert radix.cached_pages == 5
    check_pool_integrity(alloc, radix, in_use_pages=0)


def test_insert_accepts_arrays_and_truncates_to_pages() -> None:
    alloc, radix = make(page_size=4)
    slots = alloc.alloc_slots(0, None, 6)
    assert slots is not None
    assert radix.insert(np.arange(6), np.array(slots)) == 0
    assert radix.cached_pages == 1
    alloc.free_slots(slots[4:])
    assert radix.match_prefix((0, 1, 2, 3, 4)).slots == slots[:4]
    check_pool_integrity(alloc, radix, in_use_pages=0)


def test_insert_rejects_bad_input() -> None:
    alloc, radix = make(page_size=4)
    with pytest.raises(ValueError):
        radix.insert([1, 2, 3, 4], [4, 5, 6])
    with pytest.raises(PoolInvariantError):
        radix.insert([1, 2, 3, 4], [5, 6, 7, 8])  # slot 5 does not start a page
    with pytest.raises(PoolInvariantError):
        radix.insert([1, 2, 3, 4], [0, 1, 2, 3])  # reserved page 0
    assert radix.cached_pages == 0
    radix.check_integrity()


@pytest.mark.parametrize("page_size", [1, 16])
def test_lock_protects_from_eviction(page_size: int) -> None:
    alloc, radix = make(page_size)
    a = [1] * page_size + [2] * page_size
    b = [1] * page_size + [3] * page_size
    slots_a = run_request(alloc, radix, a)
    run_request(alloc, radix, b)
    assert (radix.evictable_pages, radix.protected_pages) == (3, 0)
    node = radix.match_prefix(a + [0]).last_node
    assert radix.inc_lock_ref(node) == 2
    assert radix.inc_lock_ref(node) == 0
    assert (radix.evictable_pages, radix.protected_pages) == (1, 2)
    assert radix.evict(100) == 1  # only b's own page
    assert radix.match_prefix(a + [0]).slots == slots_a
    assert radix.match_prefix(b + [0]).slots == slots_a[:page_size]
    assert radix.dec_lock_ref(node) == 0
    assert radix.dec_lock_ref(node) == 2
    with pytest.raises(PoolInvariantError):
        radix.dec_lock_ref(node)
    assert radix.evict(100) == 2
    assert radix.cached_pages == 0 and alloc.num_free == alloc.num_usable
    with pytest.raises(PoolInvariantError):
        radix.inc_lock_ref(node)  # evicted
    check_pool_integrity(alloc, radix, in_use_pages=0)


def test_lock_handle_survives_split() -> None:
    alloc, radix = make(page_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    run_request(alloc, radix, tokens)
    node = radix.match_prefix(tokens + [7]).last_node
    radix.inc_lock_ref(node)
    radix.match_prefix([1, 2, 9, 9, 9])  # splits node's edge above it
    assert radix.num_nodes == 2 and radix.protected_pages == 3
    assert radix.dec_lock_ref(node) == 3
    radix.check_integrity()


def test_lru_eviction_order() -> None:
    alloc, radix = make(page_size=2)
    seqs = {name: [tok] * 4 for name, tok in (("a", 1), ("b", 2), ("c", 3))}
    slots = {name: run_request(alloc, radix, seq) for name, seq in seqs.items()}
    radix.match_prefix(seqs["a"] + [0])  # a is now the most recent
    order = []
    for _ in range(3):
        free_before = set(p for p in range(1, alloc.num_pages) if alloc.is_free(p))
        assert radix.evict(1) == 2  # a whole leaf (2 pages) goes at once
        freed = {p for p in range(1, alloc.num_pages) if alloc.is_free(p)} - free_before
        order.append(next(n for n, s in slots.items() if set(alloc.pages_of(s)) == freed))
        radix.check_integrity()
    assert order == ["b", "c", "a"]
    assert radix.evict(1) == 0


def test_parent_becomes_evictable_leaf() -> None:
    alloc, radix = make(page_size=1)
    run_request(alloc, radix, [1, 2, 3, 4])
    run_request(alloc, radix, [1, 2, 5, 6])
    assert radix.num_nodes == 3
    assert radix.evict(2) == 2
    assert radix.num_nodes == 2
    assert radix.evict(3) == 4  # the other leaf, then [1, 2] once it became a leaf
    assert radix.num_nodes == 0 and radix.cached_pages == 0
    check_pool_integrity(alloc, radix, in_use_pages=0)


def test_disabled_cache_stores_nothing() -> None:
    alloc, radix = make(page_size=4, disable=True)
    tokens = list(range(12))
    slots = alloc.alloc_slots(0, None, 12)
    assert slots is not None
    assert radix.insert(tokens, slots) == 0
    alloc.free_slots(slots)
    res = radix.match_prefix(tokens)
    assert res.slots == [] and res.last_node is radix.root
    assert radix.inc_lock_ref(res.last_node) == 0 and radix.dec_lock_ref(res.last_node) == 0
    assert radix.cached_pages == 0 and radix.evict(10) == 0
    check_pool_integrity(alloc, radix, in_use_pages=0)


def test_reset_frees_everything_unless_locked() -> None:
    alloc, radix = make(page_size=2)
    run_request(alloc, radix, [1, 2, 3, 4])
    run_request(alloc, radix, [1, 2, 5, 6, 7])
    node = radix.match_prefix([1, 2, 3, 4, 0]).last_node
    radix.inc_lock_ref(node)
    with pytest.raises(PoolInvariantError):
        radix.reset()
    radix.dec_lock_ref(node)
    radix.reset()
    assert radix.cached_pages == 0 and alloc.num_free == alloc.num_usable
    assert radix.match_prefix([1, 2, 3, 4, 0]).slots == []
    check_pool_integrity(alloc, radix, in_use_pages=0)


def test_chunked_request_switches_to_tree_slots() -> None:
    """Insert a prefilled chunk, free the duplicates, and re-read the tree's slots (module docstring)."""
    alloc, radix = make(page_size=2)
    tokens = [5, 6, 7, 8, 9]
    cached = run_request(alloc, radix, tokens[:4])
    own = alloc.alloc_slots(0, None, 5)  # a request that raced the first one
    assert own is not None
    node = radix.root
    assert radix.insert(tokens[:4], own[:4]) == 4
    alloc.free_slots(own[:4])
    res = radix.match_prefix(tokens[:4], include_last=True)
    assert res.slots == cached
    radix.inc_lock_ref(res.last_node)
    radix.dec_lock_ref(node)
    row = res.slots + own[4:]  # the partial page stays request-owned
    assert alloc.pages_of(row[4:]) == [own[4] // 2]
    check_pool_integrity(alloc, radix, in_use_pages=1)
    radix.dec_lock_ref(res.last_node)
    alloc.free_slots(row[4:])
    check_pool_integrity(alloc, radix, in_use_pages=0)


def test_integrity_detects_leak_and_corruption() -> None:
    alloc, radix = make(page_size=1)
    run_request(alloc, radix, [1, 2, 3])
    leaked = alloc.alloc(1)
    assert leaked is not None
    with pytest.raises(AssertionError, match="1 pages leaked"):
        check_pool_integrity(alloc, radix, in_use_pages=0)
    check_pool_integrity(alloc, radix, in_use_pages=1)
    radix._evictable_pages += 1
    with pytest.raises(PoolInvariantError, match="counters"):
        radix.check_integrity()
    radix._evictable_pages -= 1
    node = radix.match_prefix([1, 2, 3, 4]).last_node
    alloc.free(alloc.pages_of(node.value[:1]))  # a tree page freed behind the tree's back
    with pytest.raises(PoolInvariantError, match="free or stored twice"):
        radix.check_integrity()
