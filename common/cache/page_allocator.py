"""Free-page bookkeeping for the paged KV pool, in plain Python ints.

Page 0 is reserved (scratch target for padded writes, see kv_pool.py), so the
allocator manages pages 1 .. num_pages - 1. A token slot is an index into the
per-layer K/V tensors: slot = page * page_size + offset_in_page.

Who owns what: every page is in exactly one place at a time: free (here), owned
by a running request (its ReqToTokenPool row points at it), or owned by the
RadixCache. The allocator only knows "free or not"; free + cached + in use ==
num_usable is checked by `check_pool_integrity` in __init__.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from common.cache.errors import PoolInvariantError


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need the reserved page 0 plus at least one usable page")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        # Free pages live in two lists: `_free`, sorted descending (alloc pops its tail, so pages
        # come out ascending), and `_released`, freed since the last merge. When `_free` runs
        # short the two are merged and sorted again. Pages handed out are thus mostly
        # ascending runs even after interleaved frees, and a KV transfer moves a run as one
        # descriptor (interleaved decode steps with page_size 1 otherwise scatter every page).
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._released: list[int] = []
        self._is_free = bytearray(num_pages)
        self._is_free[1:] = b"\x01" * (num_pages - 1)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._released)

    @property
    def num_allocated(self) -> int:
        return self.num_usable - self.num_free

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    def alloc(self, n: int) -> list[int] | None:
        """n distinct pages, or None (and nothing taken) when fewer than n are free."""
        if n < 0:
            raise ValueError(f"alloc({n}): negative page count")
        if n > len(self._free):
            if n > self.num_free:
                return None
            self._merge_released()
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()
        is_free = self._is_free
        for p in pages:
            is_free[p] = 0
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Give pages back. All or nothing: a page out of range or already free raises and frees none."""
        pages = [int(p) for p in pages]
        is_free = self._is_free
        for i, p in enumerate(pages):
            if not 0 < p < self.num_pages or is_free[p]:
                for q in pages[:i]:
                    is_free[q] = 0
                what = "out of range" if not 0 < p < self.num_pages else "already free (double free)"
                raise PoolInvariantError(f"free(): page {p} is {what}; num_pages={self.num_pages}")
            is_free[p] = 1
        self._released.extend(pages)

    def _merge_released(self) -> None:
        self._free.extend(self._released)
        self._released.clear()
        self._free.sort(reverse=True)

    def alloc_slots(self, seq_len: int, last_slot: int | None, n: int) -> list[int] | None:
        """Token slots for n tokens appended to a sequence of seq_len tokens; None if out of pages.

        The sequence's last token sits at `last_slot` (None when seq_len == 0; ignored
        when the last page is full). That page still has (-seq_len) % page_size free
        slots; those are used first, then whole new pages. All or nothing: on None no
        page was taken.

            page_size = 4, seq_len = 6 (tokens t0..t5), last_slot = 29 (page 7, offset 1), n = 7

              page 7 (already owned)    new page a                    new page b
            | 28 | 29 | 30 | 31 |      | 4a | 4a+1 | 4a+2 | 4a+3 |   | 4b | -- | -- | -- |
              t4   t5   ^^^^^^^          ^^^^^^^^^^^^^^^^^^^^^^^^     ^^^^
                        (-6) % 4 = 2     7 - 2 = 5 fresh slots -> ceil(5 / 4) = 2 new pages

            -> [30, 31, 4a, 4a+1, 4a+2, 4a+3, 4b]   (the rest of page b stays unused)
        """
        ps = self.page_size
        if n < 0 or seq_len < 0:
            raise ValueError(f"alloc_slots(seq_len={seq_len}, n={n}): negative length")
        room = (-seq_len) % ps
        out: list[int] = []
        if room:
            if last_slot is None or last_slot % ps != (seq_len - 1) % ps:
                raise PoolInvariantError(
                    f"alloc_slots: last_slot={last_slot} is not at offset {(seq_len - 1) % ps} of its page "
                    f"(seq_len={seq_len}, page_size={ps})"
                )
            take = min(room, n)
            out = list(range(last_slot + 1, last_slot + 1 + take))
            n -= take
        if n == 0:
            return out
        pages = self.alloc(-(-n // ps))
        if pages is None:
            return None
        if ps == 1:
            out.extend(pages)
        else:
            for p in pages:
                base = p * ps
                out.extend(range(base, base + ps))
            del out[len(out) - (-n % ps) :]
        return out

    def pages_of(self, slots: Sequence[int]) -> list[int]:
        """Distinct pages of a page-aligned run of slots (each page's first slot at offset 0)."""
        ps = self.page_size
        heads = [int(s) for s in slots[::ps]]
        if ps == 1:
            return heads
        for s in heads:
            if s % ps:
                raise PoolInvariantError(f"pages_of: slot {s} does not start a page (page_size={ps})")
        return [s // ps for s in heads]

    def free_slots(self, slots: Sequence[int]) -> None:
        """free(pages_of(slots)) for a run that starts at a page boundary (a request-owned region)."""
        self.free(self.pages_of(slots))

    def check_integrity(self) -> None:
        """Free lists and free flags agree; no duplicates; page 0 never free."""
        free = self._free + self._released
        if self._is_free[0]:
            raise PoolInvariantError("reserved page 0 is marked free")
        if len(set(free)) != len(free):
            raise PoolInvariantError("free stack holds a page twice")
        if any(not 0 < p < self.num_pages for p in free):
            raise PoolInvariantError("free stack holds a page out of range")
        flagged = sum(self._is_free)
        if flagged != len(free) or not all(self._is_free[p] for p in free):
            raise PoolInvariantError(f"free flags ({flagged}) disagree with the free stack ({len(free)})")

    def __repr__(self) -> str:
        return f"PageAllocator(free={self.num_free}/{self.num_usable}, page_size={self.page_size})"
