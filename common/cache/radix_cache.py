"""Radix prefix cache over token ids, at page granularity (plain Python, no torch).

Keys are token-id sequences, values the token slots holding their KV. Only whole
pages are stored; a node's children are keyed by their first page (a tuple of
page_size token ids, or the bare token id when page_size == 1), and a partial
match splits a node at a page boundary. Evictable leaves sit in an LRU heap, so
evicting one costs O(log n).

Ownership: every usable page is free (PageAllocator), owned by one running
request, or owned by this tree. For one request:

    token position:  0                prefix_len                 aligned_len      seq_len
                     |  matched prefix  |  request-owned pages     |  partial page  |
                     |  TREE-owned      |  (allocator.alloc_slots) |  request-owned |

- match_prefix(): the returned slots stay the tree's. The caller locks
  `last_node` (inc_lock_ref) right away, before anything can evict, and unlocks
  it (dec_lock_ref) when done with them; it never frees them. Locking moves
  pages from evictable to protected, so recheck a memory budget after it.
  NOTE: a node handle stays valid across splits (the new node goes above it).
- insert(tokens, slots) (request finished, or a prefill chunk done) returns
  `already`, the number of leading tokens the tree held before the call:
      [0, prefix_len)            the tree's already: nothing to do
      [prefix_len, already)      duplicates (another request cached them meanwhile):
                                 the caller frees them, allocator.free_slots(slots[prefix_len:already])
      [already, aligned_len)     now TREE-owned: the caller must never free them
      [aligned_len, seq_len)     the partial last page is never inserted: the caller
                                 frees it when the request is done, or keeps it
  then the caller dec_lock_ref()s its old last_node.
- A request that keeps running after insert() (chunked prefill) has freed its
  duplicate slots, so it must switch to the tree's: match_prefix(tokens[:aligned_len],
  include_last=True), write those slots into its ReqToTokenPool row, lock the new
  last_node and unlock the old one.
- evict() frees tree-owned pages of unlocked LRU leaves to the allocator;
  reset() frees all of them (no node may be locked).
- events: told the chain hash of every page the tree starts holding (insert) or stops
  holding (eviction, reset), for the router's view of this instance (KV events).
- With disable=True, match_prefix() returns nothing and insert() stores nothing
  (returns 0: the caller frees everything), so the caller's code path is the same.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from common.cache.errors import PoolInvariantError
from common.cache.kv_events import ROOT_HASH, KVEventSink, page_hashes
from common.cache.page_allocator import PageAllocator
from common.cache.radix_node import EvictableLeaves, TreeNode

ChildKey = int | tuple[int, ...]


class IntArray(Protocol):
    """A numpy array or torch tensor of ints (anything with .tolist())."""

    def tolist(self) -> Any: ...


Ints = Sequence[int] | IntArray


class MatchResult(NamedTuple):
    slots: list[int]  # token slots of the matched prefix (tree-owned; len is a multiple of page_size)
    last_node: TreeNode  # lock this to keep the prefix; the root when nothing matched


def as_ids(xs: Ints) -> array[int]:
    """A compact int32 copy: 4 bytes a token in the tree where a list of ints costs ~40."""
    if isinstance(xs, array) and xs.typecode == "i":
        return xs
    if isinstance(xs, Sequence):
        return array("i", xs)
    return array("i", xs.tolist())  # numpy arrays and torch tensors, without importing either


class RadixCache:
    def __init__(
        self, allocator: PageAllocator, page_size: int, *, disable: bool = False, events: KVEventSink | None = None
    ) -> None:
        if allocator.page_size != page_size:
            raise ValueError(f"page_size {page_size} != allocator.page_size {allocator.page_size}")
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self.events = events
        self._clock = 0
        self._clear()

    def _clear(self) -> None:
        self._root = TreeNode(array("i"), array("i"), None, 0)
        self._leaves = EvictableLeaves()
        self._evictable_pages = 0
        self.num_evicted_pages = 0  # pages evicted since the cache was built or cleared (a counter)
        self._protected_pages = 0
        self._num_nodes = 0

    @property
    def root(self) -> TreeNode:
        return self._root

    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    @property
    def protected_pages(self) -> int:
        return self._protected_pages

    @property
    def cached_pages(self) -> int:
        return self._evictable_pages + self._protected_pages

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    def match_prefix(self, token_ids: Ints, *, include_last: bool = False) -> MatchResult:
        """Longest cached page-aligned prefix of token_ids[:-1]; touches its LRU time.

        The last token is never matched, so at least one token is always computed;
        include_last=True lifts that (only for re-reading the tree's slots after insert).
        """
        if self.disable:
            return MatchResult([], self._root)
        tokens = as_ids(token_ids)
        end = len(tokens) if include_last else len(tokens) - 1
        end -= end % self.page_size
        if end <= 0:
            return MatchResult([], self._root)
        self._clock += 1
        slots: list[int] = []
        node, _ = self._walk(tokens, end, slots)
        if node is not self._root:
            self._leaves.touched(node)
        return MatchResult(slots, node)

    def insert(self, token_ids: Ints, slots: Ints) -> int:
        """Insert the page-aligned part of (token_ids -> slots); return how many leading tokens were cached.

        The tree takes ownership of the pages of slots[returned : aligned_len]; the
        caller keeps (and frees) everything else it owns (see the module docstring).
        """
        if self.disable:
            return 0
        tokens, values = as_ids(token_ids), as_ids(slots)
        if len(tokens) != len(values):
            raise ValueError(f"insert: {len(tokens)} token ids but {len(values)} slots")
        ps = self.page_size
        end = len(tokens) - len(tokens) % ps
        if end == 0:
            return 0
        self._clock += 1
        node, pos = self._walk(tokens, end, None)
        if pos == end:
            if node is not self._root:
                self._leaves.touched(node)
            return pos
        value = values[pos:end]
        for s in value[::ps]:
            if s % ps or s < ps:
                raise PoolInvariantError(f"insert: slot {s} does not start a usable page (page_size={ps})")
        leaf = TreeNode(tokens[pos:end], value, node, self._clock)
        node.children[self._child_key(leaf.key, 0)] = leaf
        if self.events is not None:
            leaf.hashes = page_hashes(leaf.key, ps, node.hashes[-1] if node.hashes else ROOT_HASH)
            self.events.stored(leaf.hashes)
        self._leaves.discard(node)
        self._leaves.add(leaf)
        self._evictable_pages += len(value) // ps
        self._num_nodes += 1
        return pos

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock the path root..node against eviction; returns pages moved from evictable to protected."""
        if node is not self._root and node.parent is None:
            raise PoolInvariantError(f"inc_lock_ref on an evicted node: {node}")
        moved = 0
        while node is not self._root:
            if node.lock_ref == 0:
                moved += len(node.value) // self.page_size
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]
        self._evictable_pages -= moved
        self._protected_pages += moved
        return moved

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Undo one inc_lock_ref(node); returns pages moved from protected to evictable."""
        if node is self._root:
            return 0
        if node.lock_ref <= 0:
            raise PoolInvariantError(f"dec_lock_ref below zero: {node}")
        moved = 0
        while node is not self._root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                moved += len(node.value) // self.page_size
                if not node.children:
                    self._leaves.add(node)
            node = node.parent  # type: ignore[assignment]
        self._protected_pages -= moved
        self._evictable_pages += moved
        return moved

    def evict(self, num_pages: int) -> int:
        """Free unlocked LRU leaves (whole nodes) until num_pages pages are freed or none is left."""
        freed = 0
        while freed < num_pages:
            leaf = self._leaves.pop_oldest()
            if leaf is None:
                break
            freed += self._remove_leaf(leaf)
        self.num_evicted_pages += freed
        return freed

    def reset(self) -> None:
        """Free every tree-owned page to the allocator and start empty. No node may be locked."""
        if self._protected_pages:
            raise PoolInvariantError(f"reset() while {self._protected_pages} pages are locked by requests")
        pages: list[int] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            pages.extend(self.allocator.pages_of(node.value))
        self.allocator.free(pages)
        self._clear()
        if self.events is not None:
            self.events.cleared()

    def _child_key(self, tokens: array[int], pos: int) -> ChildKey:
        return tokens[pos] if self.page_size == 1 else tuple(tokens[pos : pos + self.page_size])

    def _walk(self, tokens: array[int], end: int, slots: list[int] | None) -> tuple[TreeNode, int]:
        """Follow tokens[:end] down the tree, splitting at the divergence, touching each node.

        Returns the deepest node whose path is a prefix of tokens[:end] and that
        path's length; appends the path's slots to `slots` when given.
        """
        ps, clock = self.page_size, self._clock
        node, pos = self._root, 0
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            key = child.key
            n = min(len(key), end - pos)
            n -= n % ps
            if key[:n] != tokens[pos : pos + n]:
                n = next(i for i in range(ps, n) if key[i] != tokens[pos + i])
                n -= n % ps
            if n < len(key):
                child = self._split(child, n)
            child.last_access = clock
            if slots is not None:
                slots.extend(child.value)
            node, pos = child, pos + n
        return node, pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child's edge after n tokens; the new node is the PARENT, so handles to child stay valid."""
        parent = child.parent
        assert parent is not None
        top = TreeNode(child.key[:n], child.value[:n], parent, child.last_access)
        top.lock_ref = child.lock_ref
        top.hashes, child.hashes = child.hashes[: n // self.page_size], child.hashes[n // self.page_size :]
        top.children[self._child_key(child.key, n)] = child
        parent.children[self._child_key(child.key, 0)] = top
        child.key, child.value, child.parent = child.key[n:], child.value[n:], top
        self._num_nodes += 1
        return top

    def _remove_leaf(self, leaf: TreeNode) -> int:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        self.allocator.free_slots(leaf.value)
        del parent.children[self._child_key(leaf.key, 0)]
        leaf.parent = None
        if self.events is not None:
            self.events.removed(leaf.hashes)
        pages = len(leaf.value) // self.page_size
        self._evictable_pages -= pages
        self._num_nodes -= 1
        if parent is not self._root and not parent.children and parent.lock_ref == 0:
            self._leaves.add(parent)
        return pages

    def check_integrity(self) -> None:
        """Recount everything from the tree; raise PoolInvariantError on any disagreement."""
        ps, alloc = self.page_size, self.allocator
        evictable = protected = nodes = 0
        seen_pages: set[int] = set()
        leaves: set[TreeNode] = set()
        stack = [self._root]
        while stack:
            node = stack.pop()
            for ck, child in node.children.items():
                where = f"node {child}"
                if child.parent is not node or not child.key or ck != self._child_key(child.key, 0):
                    raise PoolInvariantError(f"{where}: wrong parent link or child key")
                if len(child.key) != len(child.value) or len(child.key) % ps:
                    raise PoolInvariantError(
                        f"{where}: key/value lengths {len(child.key)}/{len(child.value)}"
                    )
                if child.lock_ref < 0 or (node is not self._root and node.lock_ref < child.lock_ref):
                    raise PoolInvariantError(f"{where}: lock_ref {child.lock_ref} < 0 or above its parent's")
                if node is not self._root and node.last_access < child.last_access:
                    raise PoolInvariantError(f"{where}: accessed after its parent")
                if self.events is not None and len(child.hashes) * ps != len(child.key):
                    raise PoolInvariantError(f"{where}: {len(child.hashes)} page hashes for {len(child.key)} tokens")
                for i in range(0, len(child.value), ps):
                    first = child.value[i]
                    page = first // ps
                    if first % ps or child.value[i : i + ps] != array("i", range(first, first + ps)):
                        raise PoolInvariantError(f"{where}: slots at {i} are not one whole page")
                    if not 0 < page < alloc.num_pages or alloc.is_free(page) or page in seen_pages:
                        raise PoolInvariantError(f"{where}: page {page} is reserved, free or stored twice")
                    seen_pages.add(page)
                pages = len(child.value) // ps
                if child.lock_ref:
                    protected += pages
                else:
                    evictable += pages
                    if not child.children:
                        leaves.add(child)
                nodes += 1
                stack.append(child)
        if (evictable, protected, nodes) != (self._evictable_pages, self._protected_pages, self._num_nodes):
            raise PoolInvariantError(
                f"counters (evictable, protected, nodes) = {(self._evictable_pages, self._protected_pages, self._num_nodes)}"
                f" but the tree holds {(evictable, protected, nodes)}"
            )
        self._leaves.check_integrity(leaves)

    def format_tree(self, max_tokens: int = 8) -> str:
        lines = [
            f"RadixCache(page_size={self.page_size}, nodes={self._num_nodes}, "
            f"evictable={self._evictable_pages}, protected={self._protected_pages} pages)"
        ]
        stack = [(child, 1) for child in reversed(self._root.children.values())]
        while stack:
            node, depth = stack.pop()
            more = "..." if len(node.key) > max_tokens else ""
            lines.append(
                f"{'  ' * depth}{node.key[:max_tokens].tolist()}{more} tokens={len(node.key)} "
                f"lock={node.lock_ref} t={node.last_access} slots[0]={node.value[0]}"
            )
            stack.extend((child, depth + 1) for child in reversed(node.children.values()))
        return "\n".join(lines)

    def pretty_print(self) -> None:
        print(self.format_tree())
