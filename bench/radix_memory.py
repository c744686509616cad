"""Radix cache: Python bytes per cached token and match/insert speed (issue 41, prefill RSS).

Fills a RadixCache (page 16, events on) with distinct random prompts until its pool is full,
the way a prefill instance's cache fills under a soak, and reports the bytes tracemalloc sees
per cached token, then times match_prefix and insert of prompts that share a prefix.

    python bench/radix_memory.py --pool-tokens 46608
    ... RESULT {"bytes_per_cached_token": ..., "match_us": ..., "insert_us": ...}
"""

from __future__ import annotations

import argparse
import json
import random
import time
import tracemalloc

from machine_info import cpu_name

from common.cache.page_allocator import PageAllocator
from common.cache.radix_cache import RadixCache


class NullSink:
    def stored(self, hashes: list[int]) -> None: ...
    def removed(self, hashes: list[int]) -> None: ...
    def cleared(self) -> None: ...


def fill(cache: RadixCache, alloc: PageAllocator, rng: random.Random, min_len: int, max_len: int) -> int:
    ps, n = cache.page_size, 0
    while True:
        length = rng.randint(min_len, max_len)
        pages = alloc.alloc(length // ps) if length >= ps else []
        if pages is None:
            return n
        ids = [rng.randrange(100, 49152) for _ in range(length)]
        slots = [p * ps + i for p in pages for i in range(ps)] + [0] * (length % ps)
        cache.insert(ids, slots)
        n += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pool-tokens", type=int, default=46608, help="the default CPU pool (1 GiB, default model)")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=30)
    ap.add_argument("--max-len", type=int, default=260)
    ap.add_argument("--timed", type=int, default=2000, help="match/insert pairs timed")
    args = ap.parse_args()
    ps = args.page_size
    alloc = PageAllocator(args.pool_tokens // ps + 1, ps)
    rng = random.Random(0)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    cache = RadixCache(alloc, ps, events=NullSink())
    prompts = fill(cache, alloc, rng, args.min_len, args.max_len)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    tokens = cache.cached_pages * ps
    cache.check_integrity()
    # timing: a shared 512-token system prompt, then distinct turns; evict to make room
    system = [rng.randrange(100, 49152) for _ in range(512)]
    match_s = insert_s = 0.0
    for _ in range(args.timed):
        ids = system + [rng.randrange(100, 49152) for _ in range(rng.randint(16, 256))]
        t0 = time.perf_counter()
        res = cache.match_prefix(ids)
        t1 = time.perf_counter()
        cache.inc_lock_ref(res.last_node)
        need = (len(ids) - len(res.slots)) // ps
        pages = alloc.alloc(need) if need else []
        if pages is None:
            cache.evict(need)
            pages = alloc.alloc(need)
        assert pages is not None
        slots = res.slots + [p * ps + i for p in pages for i in range(ps)] + [0] * (len(ids) % ps)
        t2 = time.perf_counter()
        already = cache.insert(ids, slots)
        t3 = time.perf_counter()
        alloc.free_slots(slots[len(res.slots):already])
        cache.dec_lock_ref(res.last_node)
        match_s += t1 - t0
        insert_s += t3 - t2
    cache.check_integrity()
    result = {
        "bytes_per_cached_token": round(held / tokens, 1), "cached_tokens": tokens, "prompts": prompts,
        "held_mib": round(held / 2**20, 2), "nodes": cache.num_nodes,
        "match_us": round(match_s / args.timed * 1e6, 1), "insert_us": round(insert_s / args.timed * 1e6, 1),
        "cpu": cpu_name(),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
