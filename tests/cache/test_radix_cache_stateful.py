"""Random request traffic against PageAllocator + RadixCache, checked against a reference model.

The machine plays the scheduler: it matches, locks, allocates, decodes, caches
chunks, finishes, aborts and evicts. The model is a dict from every cached
page-aligned prefix to the page holding that prefix's last page, plus per-prefix
lock counts and last-touch times. After every step the tree must equal the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from common.cache import PageAllocator, RadixCache, TreeNode, check_pool_integrity

Prefix = tuple[int, ...]
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=12)
INDEX = st.integers(0, 1000)


@dataclass
class Running:
    tokens: list[int]
    slots: list[int]
    prefix_len: int  # [0, prefix_len) is tree-owned and locked through `node`
    node: TreeNode


class RadixMachine(RuleBasedStateMachine):
    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        num_pages=st.integers(6, 32),
        disable=st.sampled_from([False, False, False, True]),
    )
    def setup(self, page_size: int, num_pages: int, disable: bool) -> None:
        self.ps = page_size
        self.alloc = PageAllocator(num_pages, page_size)
        self.radix = RadixCache(self.alloc, page_size, disable=disable)
        self.running: list[Running] = []
        self.ref: dict[Prefix, int] = {}
        self.locks: dict[Prefix, int] = {}
        self.touched: dict[Prefix, int] = {}
        self.clock = 0

    # -- reference model ------------------------------------------------------------------

    def _aligned(self, tokens: list[int], n: int) -> list[Prefix]:
        return [tuple(tokens[:k]) for k in range(self.ps, n - n % self.ps + 1, self.ps)]

    def _expected_match(self, tokens: list[int], end: int) -> list[int]:
        slots: list[int] = []
        for prefix in self._aligned(tokens, end):
            if prefix not in self.ref:
                break
            page = self.ref[prefix]
            slots.extend(range(page * self.ps, (page + 1) * self.ps))
        return slots

    def _touch(self, tokens: list[int], n: int) -> None:
        self.clock += 1
        for prefix in self._aligned(tokens, n):
            if prefix in self.ref:
                self.touched[prefix] = self.clock

    def _lock(self, tokens: list[int], n: int, delta: int) -> None:
        for prefix in self._aligned(tokens, n):
            self.locks[prefix] = self.locks.get(prefix, 0) + delta
            assert self.locks[prefix] >= 0

    def _is_leaf(self, prefix: Prefix) -> bool:
        return not any(len(p) == len(prefix) + self.ps and p[: len(prefix)] == prefix for p in self.ref)

    def _match(self, tokens: list[int], *, include_last: bool = False) -> tuple[list[int], TreeNode]:
        end = len(tokens) if include_last else len(tokens) - 1
        expected = self._expected_match(tokens, end)
        slots, node = self.radix.match_prefix(tokens, include_last=include_last)
        assert slots == expected, (tokens, slots, expected)
        assert len(slots) % self.ps == 0 and len(slots) < len(tokens) + include_last
        self._touch(tokens, len(slots))
        return slots, node

    def _insert(self, tokens: list[int], slots: list[int]) -> int:
        already = self.radix.insert(tokens, slots)
        aligned = len(tokens) - len(tokens) % self.ps
        assert already == len(self._expected_match(tokens, aligned))
        if not self.radix.disable:
            for k in range(already + self.ps, aligned + 1, self.ps):
                self.ref[tuple(tokens[:k])] = slots[k - self.ps] // self.ps
            self._touch(tokens, aligned)
        return already

    def _evict(self, num_pages: int) -> int:
        free_before = {p for p in range(1, self.alloc.num_pages) if self.alloc.is_free(p)}
        evictable_before = sum(1 for p in self.ref if not self.locks.get(p))
        freed = self.radix.evict(num_pages)
        newly = {p for p in range(1, self.alloc.num_pages) if self.alloc.is_free(p)} - free_before
        removed = {prefix for prefix, page in self.ref.items() if page in newly}
        assert len(newly) == len(removed) == freed
        assert not any(self.locks.get(p) for p in removed), "evicted a locked prefix"
        assert freed >= min(num_pages, evictable_before)
        for prefix in removed:
            del self.ref[prefix]
        for prefix in self.ref:
            assert prefix[: -self.ps] in self.ref or len(prefix) == self.ps, (
                "evicted a parent, kept its child"
            )
        if removed:
            oldest_kept = min(
                (self.touched[p] for p in self.ref if not self.locks.get(p) and self._is_leaf(p)),
                default=None,
            )
            newest_evicted = max(self.touched[p] for p in removed)
            assert oldest_kept is None or newest_evicted <= oldest_kept, "eviction is not LRU"
        return freed

    def _alloc_slots(self, seq_len: int, last_slot: int | None, n: int) -> list[int] | None:
        slots = self.alloc.alloc_slots(seq_len, last_slot, n)
        if slots is None:
            room = (-seq_len) % self.ps
            need = -(-max(0, n - room) // self.ps)
            self._evict(need - self.alloc.num_free)
            slots = self.alloc.alloc_slots(seq_len, last_slot, n)
        return slots

    # -- the scheduler's moves ------------------------------------------------------------

    @precondition(lambda self: len(self.running) < 5)
    @rule(tokens=TOKENS)
    def start(self, tokens: list[int]) -> None:
        prefix, node = self._match(tokens)
        self.radix.inc_lock_ref(node)
        self._lock(tokens, len(prefix), +1)
        own = self._alloc_slots(len(prefix), prefix[-1] if prefix else None, len(tokens) - len(prefix))
        if own is None:
            self.radix.dec_lock_ref(node)
            self._lock(tokens, len(prefix), -1)
            return
        self.running.append(Running(tokens, prefix + own, len(prefix), node))

    @precondition(lambda self: self.running)
    @rule(i=INDEX, new=TOKENS)
    def decode(self, i: int, new: list[int]) -> None:
        req = self.running[i % len(self.running)]
        new = new[: self.ps + 1]
        slots = self._alloc_slots(len(req.tokens), req.slots[-1], len(new))
        if slots is not None:
            req.tokens += new
            req.slots += slots

    @precondition(lambda self: self.running)
    @rule(i=INDEX)
    def cache_chunk(self, i: int) -> None:
        """Chunked prefill: insert what is computed, drop duplicates, continue on the tree's slots."""
        req = self.running[i % len(self.running)]
        aligned = len(req.tokens) - len(req.tokens) % self.ps
        already = self._insert(req.tokens[:aligned], req.slots[:aligned])
        self.alloc.free_slots(req.slots[req.prefix_len : already])
        if self.radix.disable:  # nothing cached: the request keeps its own pages (and freed none)
            assert already == 0
            return
        slots, node = self._match(req.tokens[:aligned], include_last=True)
        assert len(slots) == aligned and slots[already:] == req.slots[already:aligned]
        self.radix.inc_lock_ref(node)
        self._lock(req.tokens, aligned, +1)
        self.radix.dec_lock_ref(req.node)
        self._lock(req.tokens, req.prefix_len, -1)
        req.slots[:aligned] = slots
        req.prefix_len, req.node = aligned, node

    @precondition(lambda self: self.running)
    @rule(i=INDEX)
    def finish(self, i: int) -> None:
        req = self.running.pop(i % len(self.running))
        already = self._insert(req.tokens, req.slots)
        assert already >= req.prefix_len
        aligned = len(req.tokens) - len(req.tokens) % self.ps
        if self.radix.disable:
            self.alloc.free_slots(req.slots[req.prefix_len :])
        else:
            self.alloc.free_slots(req.slots[req.prefix_len : already])
            self.alloc.free_slots(req.slots[aligned:])
        self.radix.dec_lock_ref(req.node)
        self._lock(req.tokens, req.prefix_len, -1)

    @precondition(lambda self: self.running)
    @rule(i=INDEX)
    def abort(self, i: int) -> None:
        req = self.running.pop(i % len(self.running))
        self.alloc.free_slots(req.slots[req.prefix_len :])
        self.radix.dec_lock_ref(req.node)
        self._lock(req.tokens, req.prefix_len, -1)

    @rule(tokens=TOKENS)
    def lookup(self, tokens: list[int]) -> None:
        self._match(tokens)

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages: int) -> None:
        self._evict(num_pages)

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def pools_are_whole(self) -> None:
        in_use = sum(-(-(len(r.slots) - r.prefix_len) // self.ps) for r in self.running)
        check_pool_integrity(self.alloc, self.radix, in_use_pages=in_use)

    @invariant()
    def tree_equals_model(self) -> None:
        tree: dict[Prefix, int] = {}
        stack: list[tuple[TreeNode, Prefix]] = [(self.radix.root, ())]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                child_path = path + tuple(child.key)
                for k in range(self.ps, len(child.key) + 1, self.ps):
                    tree[path + tuple(child.key[:k])] = child.value[k - self.ps] // self.ps
                    assert self.locks.get(path + tuple(child.key[:k]), 0) == child.lock_ref
                stack.append((child, child_path))
        assert tree == self.ref
        locked = sum(1 for p in self.ref if self.locks.get(p))
        assert (self.radix.protected_pages, self.radix.evictable_pages) == (locked, len(self.ref) - locked)

    def teardown(self) -> None:
        if not hasattr(self, "running"):
            return
        for req in self.running:
            self.alloc.free_slots(req.slots[req.prefix_len :])
            self.radix.dec_lock_ref(req.node)
        self.radix.reset()
        assert self.alloc.num_free == self.alloc.num_usable
        check_pool_integrity(self.alloc, self.radix, in_use_pages=0)


RadixMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRadixMachine = RadixMachine.TestCase
