"""200 rooms between two real processes arrive byte-exact, and nowhere else."""

from __future__ import annotations

import random

import pytest
import torch

from kv_transfer import AuxSlotAllocator, KVPoll
from tests.kv_transfer.harness import (
    CANARY,
    UNTIMED,
    Driver,
    PageAlloc,
    PoolSpec,
    Worker,
    make_manager,
    make_pool,
    page_bytes,
)


def _room_plan(rng: random.Random, alloc: PageAlloc, src_pages: int) -> tuple[list[int], list[list[int]]]:
    n = rng.randint(1, 16)
    if rng.random() < 0.5:  # contiguous on both sides (coalesces to one run per buffer)
        dst = alloc.take(n)
        dst.sort()
        start = rng.randint(1, src_pages - n)
        src = list(range(start, start + n))
    else:  # scattered
        dst = alloc.take(n)
        src = [rng.randrange(1, src_pages) for _ in range(n)]
    cuts = sorted(rng.sample(range(1, n), k=min(n - 1, rng.randint(0, 3)))) if n > 1 else []
    bounds = [0, *cuts, n]
    chunks = [src[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return dst, chunks


@pytest.mark.parametrize("page_size", [1, 16])
def test_200_rooms_byte_exact(page_size: int) -> None:
    prefill_spec = PoolSpec(num_pages=256, page_size=page_size)
    decode_spec = PoolSpec(num_pages=4096, page_size=page_size, aux_slots=256)
    cfg = {**UNTIMED, "bootstrap_timeout_s": 20.0, "transfer_timeout_s": 20.0}  # 200 rooms queue up
    worker = Worker("prefill", prefill_spec, seed=7, **cfg)
    mgr, pool, aux = make_manager("decode", decode_spec, None, **cfg)
    try:
        driver = Driver(mgr)
        rng = random.Random(page_size)
        alloc, slots = PageAlloc(decode_spec.num_pages, seed=page_size), AuxSlotAllocator(decode_spec.aux_slots)
        rooms: dict[int, tuple[list[int], list[int], int]] = {}
        for i in range(200):
            room = rng.getrandbits(63)
            dst, chunks = _room_plan(rng, alloc, prefill_spec.num_pages)
            slot = slots.alloc()
            assert slot is not None
            driver.op_room(room, host="127.0.0.1", port=worker.port, dst=dst, aux_slot=slot)
            worker.call("room", room=room, chunks=chunks, first_token=1000 + i)
            rooms[room] = (dst, [p for c in chunks for p in c], 1000 + i)
            driver.step()
        driver.run_until(driver.all_terminal, 60, "all rooms terminal")
        bad = {r: s for r, s in driver.op_states()["states"].items() if s[0] != KVPoll.Success}
        assert not bad, f"rooms failed: {list(bad.items())[:3]}"
        worker.wait_states(lambda st: all(s[0] == KVPoll.Success for s in st.values()), 10, "prefill Success")

        ref = make_pool(prefill_spec, 7)
        touched: set[int] = set()
        for room, (dst, src, first) in rooms.items():
            for buf in range(2 * decode_spec.num_layers):
                for s, d in zip(src, dst, strict=True):
                    assert torch.equal(page_bytes(pool, buf, d), page_bytes(ref, buf, s)), f"room {room} page {d}"
            touched.update(dst)
            row = driver.plans[room].handle.aux_row()
            assert row is not None and (row.room, row.first_token, row.cached_tokens) == (room, first, room % 7)
            assert row.logprob == -0.25
        for buf in range(2 * decode_spec.num_layers):
            for page in set(range(decode_spec.num_pages)) - touched:
                assert bool((page_bytes(pool, buf, page) == CANARY).all()), f"stray write in page {page}"
        stats = mgr.stats()
        assert stats["transfers"] == 200 and stats["failures"] == {}
        pstats = worker.call("stats")["stats"]
        assert pstats["transfers"] == 200 and pstats["bytes"] == stats["bytes"] and pstats["gbps"] > 0
        mgr.check_integrity()
    finally:
        worker.stop()
        mgr.shutdown()
