"""Give the C heap's free pages back to the OS when the engine goes idle (glibc malloc_trim).

A prefill engine allocates activations, NIXL descriptor lists and UCX requests of varying
sizes on several threads; glibc keeps the freed chunks inside each thread's arena, so the
engine's RSS creeps up as fragmentation grows (README, Reliability: the soak). malloc_trim(0)
releases every whole free page in every arena (madvise), which bounds that growth. It runs
once per idle spell, at most every `interval_s` seconds, so a busy engine pays nothing and
an idle one re-faults its pages at most once per interval.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable


def load_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


class HeapTrimmer:
    """Call busy() on every engine iteration with work and idle() on every idle one."""

    def __init__(self, interval_s: float, trim: Callable[[int], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self._trim = trim if trim is not None else (load_malloc_trim() if interval_s > 0 else None)
        self._clock = clock
        self._last = -float("inf")
        self._dirty = False
        self.trims = 0

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0 and self._trim is not None

    def busy(self) -> None:
        self._dirty = True

    def idle(self) -> bool:
        """Trim when there was work since the last trim and interval_s have passed; True if it did."""
        if not (self._dirty and self.enabled):
            return False
        now = self._clock()
        if now - self._last < self.interval_s:
            return False
        assert self._trim is not None
        self._trim(0)
        self._last, self._dirty = now, False
        self.trims += 1
        return True
