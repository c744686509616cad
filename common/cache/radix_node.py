"""Radix tree nodes and the LRU-ordered set of evictable leaves (plain Python, no torch)."""

from __future__ import annotations

import heapq
import itertools
from array import array

from common.cache.errors import PoolInvariantError

_node_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree: `key` token ids and the token slots holding their KV (int32 arrays).

    len(key) == len(value), a whole number of pages. `lock_ref` counts the running
    requests whose matched prefix ends at or below this node; NOTE: a parent's
    lock_ref and last_access are always >= each child's. A node is detached
    (parent None) once evicted; the root has parent None too and is never evicted.
    Callers treat nodes as opaque handles for inc_lock_ref / dec_lock_ref.
    """

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id", "hashes")

    def __init__(self, key: array[int], value: array[int], parent: TreeNode | None, last_access: int) -> None:
        self.children: dict[int | tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = last_access
        self.id = next(_node_ids)
        self.hashes: list[int] = []  # chain hash of each page (common/cache/kv_events.py), when events are on

    def __repr__(self) -> str:
        head = self.key[:8].tolist()
        more = "..." if len(self.key) > 8 else ""
        return f"TreeNode(id={self.id}, key={head}{more} ({len(self.key)} tokens), lock_ref={self.lock_ref})"


class EvictableLeaves:
    """The unlocked leaves, popped oldest-first in O(log n).

    A heap of (last_access, id, node) with lazy invalidation: an entry is live
    only while its node is still a member and its last_access is unchanged;
    stale entries are skipped on pop and dropped when the heap is compacted
    (whenever it holds more than twice the members plus a constant).
    """

    def __init__(self) -> None:
        self._members: set[TreeNode] = set()
        self._heap: list[tuple[int, int, TreeNode]] = []

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, node: TreeNode) -> bool:
        return node in self._members

    def add(self, node: TreeNode) -> None:
        self._members.add(node)
        self._push(node)

    def discard(self, node: TreeNode) -> None:
        self._members.discard(node)

    def touched(self, node: TreeNode) -> None:
        """Re-order a member after its last_access changed."""
        if node in self._members:
            self._push(node)

    def pop_oldest(self) -> TreeNode | None:
        heap, members = self._heap, self._members
        while heap:
            access, _, node = heapq.heappop(heap)
            if node in members and node.last_access == access:
                members.remove(node)
                return node
        return None

    def clear(self) -> None:
        self._members.clear()
        self._heap.clear()

    def _push(self, node: TreeNode) -> None:
        heapq.heappush(self._heap, (node.last_access, node.id, node))
        if len(self._heap) > 2 * len(self._members) + 256:
            self._heap = [(n.last_access, n.id, n) for n in self._members]
            heapq.heapify(self._heap)

    def check_integrity(self, expected: set[TreeNode]) -> None:
        if self._members != expected:
            raise PoolInvariantError(
                f"evictable leaf set is off: {len(self._members - expected)} extra, "
                f"{len(expected - self._members)} missing"
            )
        live = {(node.id, access) for access, _, node in self._heap}
        missing = [n for n in self._members if (n.id, n.last_access) not in live]
        if missing:
            raise PoolInvariantError(
                f"{len(missing)} evictable leaves have no live heap entry, e.g. {missing[0]}"
            )
