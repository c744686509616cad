r"""Approximate radix tree of the token prefixes the router sent to each worker.

"Approximate" because it mirrors what was *sent*, not what the worker's own
radix cache still holds: the worker may have evicted it. Owned by one
CacheAwarePolicy; bounded by `max_tokens` (LRU leaves are evicted).

    root --[1 2 3]--> A {w1,w2} --[4 5]--> B {w1}
                                 \--[9]--> C {w2}

Every node records the workers whose inserted sequences pass through it, so a
worker's match length is the depth of the deepest node on the query's path
that lists it (a partially matched edge counts its matched part).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class _Node:
    __slots__ = ("edge", "children", "owners", "last_access", "parent")

    def __init__(self, edge: list[int], parent: _Node | None, owners: set[str], now: int) -> None:
        self.edge = edge
        self.children: dict[int, _Node] = {}
        self.owners = owners
        self.last_access = now
        self.parent = parent


def _common_len(edge: list[int], tokens: Sequence[int], start: int) -> int:
    n = min(len(edge), len(tokens) - start)
    k = 0
    while k < n and edge[k] == tokens[start + k]:
        k += 1
    return k


class PrefixTree:
    def __init__(self, max_tokens: int = 1 << 20) -> None:
        self.max_tokens = max_tokens
        self._clock = itertools.count(1)
        self.root = _Node([], None, set(), 0)
        self.total_tokens = 0

    def match(self, tokens: Sequence[int]) -> dict[str, int]:
        """worker url -> number of leading `tokens` it was sent before (only workers with > 0)."""
        best: dict[str, int] = {}
        node, i = self.root, 0
        now = next(self._clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common_len(child.edge, tokens, i)
            i += k
            child.last_access = now
            for url in child.owners:
                best[url] = i
            if k < len(child.edge):
                break
            node = child
        return best

    def insert(self, tokens: Sequence[int], url: str) -> None:
        now = next(self._clock)
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(list(tokens[i:]), node, {url}, now)
                node.children[tokens[i]] = leaf
                self.total_tokens += len(leaf.edge)
                break
            k = _common_len(child.edge, tokens, i)
            if k < len(child.edge):
                child = self._split(child, k)
            child.owners.add(url)
            child.last_access = now
            i += k
            node = child
        if self.total_tokens > self.max_tokens:
            self.evict(self.max_tokens * 9 // 10)

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut `child`'s edge after k tokens; returns the new middle node."""
        parent = child.parent
        assert parent is not None, "bug: split of the root"
        mid = _Node(child.edge[:k], parent, set(child.owners), child.last_access)
        parent.children[child.edge[0]] = mid
        child.edge = child.edge[k:]
        child.parent = mid
        mid.children[child.edge[0]] = child
        return mid

    def evict(self, target_tokens: int) -> None:
        """Drop least recently used leaves until at most `target_tokens` remain."""
        heap = [(n.last_access, id(n), n) for n in self._leaves()]
        heapq.heapify(heap)
        while heap and self.total_tokens > target_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None or leaf.children:
                continue
            del parent.children[leaf.edge[0]]
            self.total_tokens -= len(leaf.edge)
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))

    def remove_worker(self, url: str) -> None:
        """Forget a worker (removed from the registry); nodes nobody owns any more are dropped."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.owners.discard(url)
            for key, child in list(node.children.items()):
                if url in child.owners and len(child.owners) == 1:
                    del node.children[key]
                    self.total_tokens -= self._subtree_tokens(child)
                else:
                    stack.append(child)

    def _subtree_tokens(self, node: _Node) -> int:
        total, stack = 0, [node]
        while stack:
            n = stack.pop()
            total += len(n.edge)
            stack.extend(n.children.values())
        return total

    def _leaves(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                out.append(n)
        return out

    def check_integrity(self) -> None:
        """total_tokens equals the sum of edge lengths; children keyed by their first token;
        a child's owners are a subset of its parent's (the root excepted)."""
        counted = 0
        stack = [self.root]
        while stack:
            n = stack.pop()
            counted += len(n.edge)
            for key, child in n.children.items():
                assert child.edge and child.edge[0] == key, "child keyed by the wrong token"
                assert child.parent is n, "broken parent link"
                if n is not self.root:
                    assert child.owners <= n.owners, "child owner missing on parent"
                stack.append(child)
        assert counted == self.total_tokens, f"token count {self.total_tokens} != {counted}"
