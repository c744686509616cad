"""Who owns which KV page, request by request.

The ReqKVManager is the scheduler's single door to KV memory: it allocates
request rows and token slots, locks radix nodes, hands prompt pages to the
radix cache, and frees exactly what a request owns. It never touches tensors:
changes to the device-side req_to_token table are queued as SlotWrites and
applied by the model worker in step order (so a slot freed here is only reused
by a step that runs after every step that still reads it).

Page ownership of one request (see common/scheduler/req.py):

    kv_slots: [ tree-owned (locked) | request-owned ............ ]
              0                  tree_len                    kv_len
"""

from __future__ import annotations

from dataclasses import dataclass

from common.cache import PageAllocator, RadixCache, ReqToTokenPool, TreeNode
from common.scheduler.req import Req


@dataclass(frozen=True)
class SlotWrite:
    """req_to_token[row, start : start + len(slots)] = slots (applied by the worker)."""

    row: int
    start: int
    slots: list[int]


class ReqKVManager:
    def __init__(
        self, allocator: PageAllocator, radix: RadixCache, req_pool: ReqToTokenPool, *, defer_frees: bool = False
    ) -> None:
        self.allocator = allocator
        self.radix = radix
        self.req_pool = req_pool
        self.page_size = allocator.page_size
        self.pending_writes: list[SlotWrite] = []
        self.live: set[Req] = set()  # requests holding a row and/or slots
        # With defer_frees, freed request pages wait until the step in flight has completed
        # (free_deferred): a step of a just-finished request may still write its last KV
        # there, and in PD decode a NIXL write from prefill does not queue behind it.
        self.defer_frees = defer_frees
        self.deferred_pages: list[int] = []
        # With defer_frees, a release that hands pages to the radix cache inserts them at once but
        # keeps them locked until free_deferred: unlocked they are evictable, and an eviction
        # frees them at once.
        self.deferred_releases: list[Req] = []

    # ---- capacity -------------------------------------------------------------------------
    def available_tokens(self) -> int:
        """Tokens that could be allocated now (free pages + evictable cache pages)."""
        return (self.allocator.num_free + self.radix.evictable_pages) * self.page_size

    def pages_needed(self, kv_len: int, n: int) -> int:
        """New pages needed to append n tokens to a sequence of kv_len tokens."""
        ps = self.page_size
        return -(-(kv_len + n) // ps) - (-(-kv_len // ps))

    def ensure_free_pages(self, n: int) -> bool:
        short = n - self.allocator.num_free
        if short > 0:
            self.radix.evict(short)
        return self.allocator.num_free >= n

    # ---- admission ------------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> tuple[list[int], TreeNode]:
        result = self.radix.match_prefix(token_ids)
        return list(result.slots), result.last_node

    def attach_prefix(self, req: Req, slots: list[int], node: TreeNode) -> bool:
        """Give `req` a row and the matched (tree-owned) prefix; False when no row is free."""
        assert req.kv_len == 0 and req.tree_len == 0, f"attach_prefix on a request with KV: {req}"
        if req.req_pool_idx is None:
            row = self.req_pool.alloc()
            if row is None:
                return False
            req.req_pool_idx = row
        self.radix.inc_lock_ref(node)
        req.last_node = node
        req.kv_slots = list(slots)
        req.tree_len = len(slots)
        self.live.add(req)
        if slots:
            self.pending_writes.append(SlotWrite(req.req_pool_idx, 0, list(slots)))
        return True

    def alloc_tokens(self, req: Req, n: int) -> list[int] | None:
        """Slots for n tokens appended to req's KV; None when memory is short (nothing changes)."""
        assert req.req_pool_idx is not None, f"alloc_tokens without a row: {req}"
        if not self.ensure_free_pages(self.pages_needed(req.kv_len, n)):
            return None
        last = req.kv_slots[-1] if req.kv_slots else None
        slots = self.allocator.alloc_slots(req.kv_len, last, n, total=len(req.origin_input_ids))
        if slots is None:
            return None
        self.pending_writes.append(SlotWrite(req.req_pool_idx, req.kv_len, slots))
        req.kv_slots.extend(slots)
        return slots

    # ---- caching and release ----------------------------------------------------------------
    def _insertable_len(self, req: Req) -> int:
        n = min(req.kv_len, len(req.origin_input_ids) + len(req.output_ids))
        return n // self.page_size * self.page_size

    def cache_prefix(self, req: Req) -> None:
        """After a prompt is computed: move its whole pages into the radix cache (still locked
        by req), so that later requests reuse them while req keeps decoding."""
        if self.radix.disable:
            return
        aligned = self._insertable_len(req)
        if aligned <= req.tree_len:
            return
        tokens = req.fill_ids[:aligned]
        already = self.radix.insert(tokens, req.kv_slots[:aligned])
        # The tree had [tree_len, already) under other pages: our copies there are duplicates
        # (a step in flight may still read them: with defer_frees they wait for it).
        if already > req.tree_len:
            self._free_own(req.kv_slots[req.tree_len : already])
        match = self.radix.match_prefix(tokens, include_last=True)
        matched_slots, node = list(match.slots), match.last_node
        assert len(matched_slots) == aligned, f"radix lost an insert: {len(matched_slots)} != {aligned}"
        if already > req.tree_len:
            assert req.req_pool_idx is not None
            self.pending_writes.append(
                SlotWrite(req.req_pool_idx, req.tree_len, list(matched_slots[req.tree_len : already]))
            )
        self.radix.inc_lock_ref(node)
        self.radix.dec_lock_ref(req.last_node)
        req.kv_slots[:aligned] = matched_slots
        req.last_node = node
        req.tree_len = aligned

    def release(self, req: Req, *, keep_in_cache: bool = True) -> None:
        """Free everything req holds. With keep_in_cache its computed whole pages stay in the
        radix cache (unlocked, evictable); the rest goes back to the allocator. With
        defer_frees a caching release happens at the next free_deferred()."""
        if req not in self.live:
            return
        if self.defer_frees and keep_in_cache and not self.radix.disable:
            # Into the tree now, still locked by req (nothing can evict them while a step in
            # flight may write there): the cache event goes out before req's last tokens, so a
            # client's next turn finds this prefix in the router's index.
            self.cache_prefix(req)
            if req not in self.deferred_releases:
                self.deferred_releases.append(req)
            return
        self._release_now(req, keep_in_cache)

    def _release_now(self, req: Req, keep_in_cache: bool) -> None:
        own_start = req.tree_len
        if keep_in_cache and not self.radix.disable:
            aligned = self._insertable_len(req)
            if aligned > req.tree_len:
                already = self.radix.insert(req.fill_ids[:aligned], req.kv_slots[:aligned])
                if already > req.tree_len:
                    self.allocator.free_slots(req.kv_slots[req.tree_len : already])
                own_start = aligned
        if own_start < req.kv_len:
            self._free_own(req.kv_slots[own_start:])
        self.radix.dec_lock_ref(req.last_node)
        if req.req_pool_idx is not None:
            row = req.req_pool_idx
            self.pending_writes = [w for w in self.pending_writes if w.row != row]
            self.req_pool.free(row)
        req.req_pool_idx = None
        req.last_node = None
        req.kv_slots = []
        req.tree_len = 0
        self.live.discard(req)

    def _free_own(self, slots: list[int]) -> None:
        if self.defer_frees:
            self.deferred_pages.extend(self.allocator.pages_of(slots))
        else:
            self.allocator.free_slots(slots)

    def free_deferred(self) -> None:
        """Call when no step that was in flight at release time can still run."""
        if self.deferred_releases:
            releases, self.deferred_releases = self.deferred_releases, []
            for req in releases:
                self._release_now(req, keep_in_cache=True)
        if self.deferred_pages:
            pages, self.deferred_pages = self.deferred_pages, []
            self.allocator.free(pages)

    def take_pending_writes(self) -> list[SlotWrite]:
        writes, self.pending_writes = self.pending_writes, []
        return writes

    # ---- integrity --------------------------------------------------------------------------
    def in_use_pages(self) -> int:
        ps = self.page_size
        return sum(-(-(r.kv_len - r.tree_len) // ps) for r in self.live)

    def check_integrity(self) -> None:
        in_use = self.in_use_pages() + len(self.deferred_pages)
        total = self.allocator.num_usable
        free, cached = self.allocator.num_free, self.radix.cached_pages
        assert free + cached + in_use == total, (
            f"KV page leak: free {free} + cached {cached} + in use {in_use} != total {total}"
        )
        rows_used = sum(1 for r in self.live if r.req_pool_idx is not None)
        assert self.req_pool.num_free + rows_used == self.req_pool.max_reqs, (
            f"request row leak: free {self.req_pool.num_free} + used {rows_used} != {self.req_pool.max_reqs}"
        )
        self.allocator.check_integrity()
        self.radix.check_integrity()

    def stats(self) -> dict[str, float]:
        total = self.allocator.num_usable
        return {
            "kv_pages_total": total,
            "kv_pages_free": self.allocator.num_free,
            "kv_pages_cached": self.radix.cached_pages,
            "kv_pages_evicted_total": self.radix.num_evicted_pages,
            "kv_pages_in_use": self.in_use_pages() + len(self.deferred_pages),
            "kv_usage": 1.0 - self.allocator.num_free / max(1, total),
        }
