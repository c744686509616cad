"""KV memory: page allocator, request -> token table, radix prefix cache.

    every usable page (1 .. num_pages - 1) is exactly one of:
        free      PageAllocator.num_free
        cached    RadixCache.cached_pages   (evictable + protected)
        in use    owned by running requests (counted by the scheduler)

`check_pool_integrity` checks that sum; the engine calls it when idle
(in_use_pages == 0) and tests call it after every step. Importing this
package does not import torch (ReqToTokenPool, which needs it, loads lazily).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common.cache.errors import PoolInvariantError
from common.cache.page_allocator import PageAllocator
from common.cache.radix_cache import MatchResult, RadixCache
from common.cache.radix_node import TreeNode

if TYPE_CHECKING:
    from common.cache.req_to_token_pool import ReqToTokenPool

__all__ = [
    "MatchResult",
    "PageAllocator",
    "PoolInvariantError",
    "RadixCache",
    "ReqToTokenPool",
    "TreeNode",
    "check_pool_integrity",
]


def __getattr__(name: str) -> Any:
    # ReqToTokenPool needs torch; importing it lazily keeps `import common.cache` torch-free.
    if name == "ReqToTokenPool":
        from common.cache.req_to_token_pool import ReqToTokenPool

        return ReqToTokenPool
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_pool_integrity(allocator: PageAllocator, radix: RadixCache, in_use_pages: int) -> None:
    """Raise PoolInvariantError (an AssertionError) unless free + cached + in use == total pages."""
    allocator.check_integrity()
    radix.check_integrity()
    free, cached, total = allocator.num_free, radix.cached_pages, allocator.num_usable
    if free + cached + in_use_pages != total:
        diff = total - (free + cached + in_use_pages)
        what = f"{diff} pages leaked" if diff > 0 else f"{-diff} pages counted twice"
        raise PoolInvariantError(
            f"KV page accounting is off ({what}): free {free} + cached {cached} "
            f"(evictable {radix.evictable_pages}, protected {radix.protected_pages}) "
            f"+ in use {in_use_pages} != usable {total}"
        )
