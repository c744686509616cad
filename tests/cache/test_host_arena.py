"""The KV pool's host arena: zeroed, disjoint, contiguous buffers backed by huge pages where the kernel allows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from common.cache.host_arena import HUGE_PAGE, alloc_host_buffers
from common.cache.kv_pool import KVPool

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vma_of(addr: int) -> str:
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
        if lo <= addr < hi:
            return block
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_buffers_are_zeroed_disjoint_and_writable() -> None:
    shapes = [(100, 3, 7), (1, 5), (4096, 8, 64)]
    bufs = alloc_host_buffers(shapes, torch.bfloat16)
    assert [tuple(b.shape) for b in bufs] == shapes
    spans = []
    for i, b in enumerate(bufs):
        assert b.is_contiguous() and b.dtype == torch.bfloat16 and b.data_ptr() % 64 == 0
        assert not b.any()
        b.fill_(i + 1)
        spans.append((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()))
    for i, b in enumerate(bufs):
        assert bool((b == i + 1).all()), "a buffer was overwritten by its neighbour"
    spans.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:], strict=False))


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text(), reason="THP off on this kernel")
def test_kv_pool_is_huge_page_eligible() -> None:
    pool = KVPool(num_layers=2, num_pages=512, page_size=16, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    assert pool.kv.numel() * 2 >= 2 * HUGE_PAGE
    vma = _vma_of(pool.kv.data_ptr())
    assert re.search(r"^THPeligible:\s+1", vma, re.M), vma
    assert re.search(r"^VmFlags:.*\bhg\b", vma, re.M), "madvise(MADV_HUGEPAGE) was not applied"
