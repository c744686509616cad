"""Free-page bookkeeping for the paged KV pool, in plain Python ints.

Page 0 is reserved (scratch target for padded writes, see kv_pool.py), so the
allocator manages pages 1 .. num_pages - 1. A token slot is page * page_size +
offset_in_page (kv_pool.py maps it into the page-major pool).

Who owns what: every page is in exactly one place at a time: free (here), owned
by a running request (its ReqToTokenPool row points at it), or owned by the
RadixCache. The allocator only knows "free or not"; free + cached + in use ==
num_usable is checked by `check_pool_integrity` in __init__.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from common.cache.errors import PoolInvariantError


class PageAllocator:
    """Free pages as extents (runs of consecutive pages), so a request's pages come out as few
    runs as the free space allows: a KV transfer moves each run as ONE descriptor.

        runs: start -> length, last page -> start (merging on free), and size classes
              (class c holds runs of length 2**c .. 2**(c+1) - 1) to find a fitting run fast

    alloc(n, after=p, want=w) first continues right after page p when p + 1 is free (the next
    chunk of a prefill, a decode step's new page), then takes the start of the best-fitting
    single run for `want` pages (the request's whole prompt: its later chunks continue there),
    else for n, and only when no run holds n pages the largest runs.
    free() merges pages back into their neighbouring runs."""

    BEST_FIT_SCAN = 32  # runs examined in the first fitting size class before taking any that fits

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need the reserved page 0 plus at least one usable page")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self._len: dict[int, int] = {}  # run start -> length
        self._start_of_end: dict[int, int] = {}  # run last page -> start
        self._classes: list[dict[int, None]] = [{} for _ in range(num_pages.bit_length() + 1)]  # ordered sets of starts
        self._num_free = 0
        self._is_free = bytearray(num_pages)
        self._add_run(1, num_pages - 1)
        self._is_free[1:] = b"\x01" * (num_pages - 1)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_allocated(self) -> int:
        return self.num_usable - self.num_free

    @property
    def num_runs(self) -> int:
        """Free extents: 1 on an idle pool, more as allocations and frees fragment it."""
        return len(self._len)

    def is_free(self, page: int) -> bool:
        return bool(self._is_free[page])

    # ---- extents ----------------------------------------------------------------------
    def _add_run(self, start: int, length: int) -> None:
        self._len[start] = length
        self._start_of_end[start + length - 1] = start
        self._classes[length.bit_length() - 1][start] = None
        self._num_free += length

    def _remove_run(self, start: int) -> int:
        length = self._len.pop(start)
        del self._start_of_end[start + length - 1]
        del self._classes[length.bit_length() - 1][start]
        self._num_free -= length
        return length

    def _take(self, start: int, n: int) -> list[int]:
        """The first n pages of the run at `start` (n <= its length); the rest stays free."""
        length = self._remove_run(start)
        if length > n:
            self._add_run(start + n, length - n)
        is_free = self._is_free
        for p in range(start, start + n):
            is_free[p] = 0
        return list(range(start, start + n))

    def _best_fit(self, n: int) -> int | None:
        """Start of a run of >= n pages from the smallest size class holding one, or None."""
        first = n.bit_length() - 1
        best: int | None = None
        for i, start in enumerate(self._classes[first]):
            length = self._len[start]
            if length == n:
                return start
            if length > n and (best is None or length < self._len[best]):
                best = start
            if i >= self.BEST_FIT_SCAN and best is not None:
                break
        if best is not None:
            return best
        for cls in self._classes[first + 1 :]:
            if cls:
                return next(iter(cls))
        return None

    def alloc(self, n: int, after: int | None = None, want: int = 0) -> list[int] | None:
        """n distinct pages, or None (and nothing taken) when fewer than n are free.
        after: a page the caller holds; pages right after it are taken first when free.
        want: pages the caller expects to hold in the end (> n: room to grow is preferred)."""
        if n < 0:
            raise ValueError(f"alloc({n}): negative page count")
        if n > self._num_free:
            return None
        out: list[int] = []
        if n and after is not None and 0 <= after + 1 < self.num_pages and (after + 1) in self._len:
            out = self._take(after + 1, min(n, self._len[after + 1]))
        need = n - len(out)
        if need:
            start = self._best_fit(want - len(out)) if want > n else None
            if start is None:
                start = self._best_fit(need)
            if start is not None:
                out += self._take(start, need)
            else:
                for start in sorted(self._len, key=self._len.__getitem__, reverse=True):
                    take = min(need, self._len[start])
                    out += self._take(start, take)
                    need -= take
                    if not need:
                        break
        return out

    def free(self, pages: Iterable[int]) -> None:
        """Give pages back. All or nothing: a page out of range or already free raises and frees none."""
        pages = sorted(int(p) for p in pages)
        is_free = self._is_free
        for i, p in enumerate(pages):
            if not 0 < p < self.num_pages or is_free[p] or (i and pages[i - 1] == p):
                what = "out of range" if not 0 < p < self.num_pages else "already free (double free)"
                raise PoolInvariantError(f"free(): page {p} is {what}; num_pages={self.num_pages}")
        i = 0
        while i < len(pages):
            j = i
            while j + 1 < len(pages) and pages[j + 1] == pages[j] + 1:
                j += 1
            start, end = pages[i], pages[j]
            for p in range(start, end + 1):
                is_free[p] = 1
            left = self._start_of_end.get(start - 1)
            if left is not None:
                self._remove_run(left)
                start = left
            if end + 1 in self._len:
                end += self._remove_run(end + 1)
            self._add_run(start, end - start + 1)
            i = j + 1

    def alloc_slots(self, seq_len: int, last_slot: int | None, n: int, total: int = 0) -> list[int] | None:
        """Token slots for n tokens appended to a sequence of seq_len tokens; None if out of pages.
        total: the tokens the sequence is expected to reach (a chunked prompt's length): its new
        pages go where the later chunks can continue them (alloc's `want`).

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
        take_room = len(out)
        if n == 0:
            return out
        last_page = None if last_slot is None or seq_len == 0 else last_slot // ps
        pages = self.alloc(-(-n // ps), after=last_page, want=max(0, -(-(total - seq_len - take_room) // ps)))
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
        """Runs and free flags agree: runs are disjoint, maximal (never adjacent), indexed in the
        right size class, and cover exactly the pages flagged free; page 0 is never free."""
        if self._is_free[0]:
            raise PoolInvariantError("reserved page 0 is marked free")
        covered = 0
        flags = bytearray(self.num_pages)
        for start, length in self._len.items():
            end = start + length - 1
            if length < 1 or not 0 < start <= end < self.num_pages:
                raise PoolInvariantError(f"free run {start}+{length} out of range")
            if self._start_of_end.get(end) != start or start not in self._classes[length.bit_length() - 1]:
                raise PoolInvariantError(f"free run {start}+{length} is not indexed")
            if (start - 1) in self._start_of_end or (end + 1) in self._len:
                raise PoolInvariantError(f"free run {start}+{length} touches another run (not merged)")
            if any(flags[start : end + 1]):
                raise PoolInvariantError(f"free run {start}+{length} overlaps another run")
            flags[start : end + 1] = b"\x01" * length
            covered += length
        if len(self._start_of_end) != len(self._len) or sum(map(len, self._classes)) != len(self._len):
            raise PoolInvariantError("free run indexes disagree")
        if covered != self._num_free or flags != self._is_free:
            raise PoolInvariantError(f"free flags ({sum(self._is_free)}) disagree with the free runs ({covered})")

    def __repr__(self) -> str:
        return f"PageAllocator(free={self.num_free}/{self.num_usable}, page_size={self.page_size})"
