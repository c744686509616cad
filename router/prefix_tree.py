r"""Approximate radix tree of the token prefixes the router sent to each worker.

"Approximate" because it mirrors what was *sent*, not what the worker's own
radix cache still holds: the worker may have evicted it. Owned by one
CacheAwarePolicy; bounded in `max_tokens` units, where every node also costs
NODE_COST (its object, children dict and owner set outweigh a token), so many
short prompts diverging at successive positions cannot grow it past the bound.
Each insert evicts least recently used leaves until the bound holds again: a heap
of leaves (entries refreshed lazily when popped), never a sweep of the tree.

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

NODE_COST = 8  # tokens' worth of memory per node (~600 B a node vs ~8-36 B a token)


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
        self._tiebreak = itertools.count()
        self.root = _Node([], None, set(), 0)
        self.total_tokens = 0
        self.nodes = 0  # the root excepted
        self._leaves: list[tuple[int, int, _Node]] = []  # (last_access when pushed, tiebreak, leaf)

    @property
    def cost(self) -> int:
        """What the bound counts: tokens plus NODE_COST per node."""
        return self.total_tokens + NODE_COST * self.nodes

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
                self.nodes += 1
                self._push(leaf)
                break
            k = _common_len(child.edge, tokens, i)
            if k < len(child.edge):
                child = self._split(child, k)
            child.owners.add(url)
            child.last_access = now
            i += k
            node = child
        if self.cost > self.max_tokens:
            self.evict(self.max_tokens)

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut `child`'s edge after k tokens; returns the new middle node."""
        parent = child.parent
        assert parent is not None, "bug: split of the root"
        mid = _Node(child.edge[:k], parent, set(child.owners), child.last_access)
        parent.children[child.edge[0]] = mid
        child.edge = child.edge[k:]
        child.parent = mid
        mid.children[child.edge[0]] = child
        self.nodes += 1
        return mid

    def _push(self, leaf: _Node) -> None:
        heapq.heappush(self._leaves, (leaf.last_access, next(self._tiebreak), leaf))
        if len(self._leaves) > 2 * self.nodes + 1024:  # stale entries of nodes that grew children or left
            self._leaves = [(n.last_access, next(self._tiebreak), n) for n in self._leaf_nodes()]
            heapq.heapify(self._leaves)

    def evict(self, target: int) -> None:
        """Drop least recently used leaves until cost <= target (work in proportion to what goes)."""
        heap = self._leaves
        while heap and self.cost > target:
            stamp, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None or leaf.children:
                continue  # gone, or internal now (pushed again once it is a leaf)
            if leaf.last_access != stamp:
                heapq.heappush(heap, (leaf.last_access, next(self._tiebreak), leaf))
                continue
            del parent.children[leaf.edge[0]]
            leaf.parent = None
            self.total_tokens -= len(leaf.edge)
            self.nodes -= 1
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(self._tiebreak), parent))

    def remove_worker(self, url: str) -> None:
        """Forget a worker (removed from the registry); nodes nobody owns any more are dropped."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            node.owners.discard(url)
            for key, child in list(node.children.items()):
                if url in child.owners and len(child.owners) == 1:
                    del node.children[key]
                    self._detach(child)
                else:
                    stack.append(child)
            if node is not self.root and not node.children:
                self._push(node)

    def _detach(self, node: _Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            n.parent = None
            self.total_tokens -= len(n.edge)
            self.nodes -= 1
            stack.extend(n.children.values())

    def _leaf_nodes(self) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            else:
                out.append(n)
        return out

    def check_integrity(self) -> None:
        """total_tokens and nodes match the tree; children keyed by their first token; a child's
        owners are a subset of its parent's (the root excepted); every leaf is in the heap."""
        counted, nodes = 0, -1
        queued = {id(n) for _, _, n in self._leaves}
        stack = [self.root]
        while stack:
            n = stack.pop()
            counted += len(n.edge)
            nodes += 1
            assert n is self.root or n.children or id(n) in queued, "a leaf the eviction heap does not know"
            for key, child in n.children.items():
                assert child.edge and child.edge[0] == key, "child keyed by the wrong token"
                assert child.parent is n, "broken parent link"
                if n is not self.root:
                    assert child.owners <= n.owners, "child owner missing on parent"
                stack.append(child)
        assert counted == self.total_tokens, f"token count {self.total_tokens} != {counted}"
        assert nodes == self.nodes, f"node count {self.nodes} != {nodes}"
