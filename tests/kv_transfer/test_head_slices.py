"""Head-sliced WRITE descriptors between TP splits, executed on plain memory.

Every rank's page-major KV pool of both sides live in one byte array (addresses are offsets into
it); the descriptors _post_kv would post are applied as memcpys. Each destination rank must
then hold exactly its heads of the source pages in the destination pages, for every
(prefill TP, decode TP) pair, replicated heads (kv_heads < tp) included, and nothing else
may be written."""

from __future__ import annotations

import numpy as np
import pytest

from common.cache.kv_pool import KVLayout
from kv_transfer.descriptors import coalesce_pages
from kv_transfer.head_slices import (
    HeadSlice,
    build_sliced_descs,
    concat_descs,
    pair_slices,
    slices_from_wire,
    split_compatible,
    total_heads,
)

LAYERS, PAGES, HEAD_DIM = 2, 6, 4


def _split(kv_heads: int, tp: int) -> list[tuple[int, int]]:
    """(first head, heads) per rank, as TPShard splits them."""
    return [(r * kv_heads // tp, max(1, kv_heads // tp)) for r in range(tp)]


class Memory:
    def __init__(self) -> None:
        self.bytes = np.zeros(0, dtype=np.uint8)

    def alloc(self, n: int) -> int:
        base = self.bytes.size + 64  # a gap: a stray write shows up outside every buffer
        self.bytes = np.concatenate([self.bytes, np.zeros(n + 64, dtype=np.uint8)])
        return base

    def apply(self, local: np.ndarray, remote: np.ndarray) -> None:
        for (src, n, _), (dst, m, _) in zip(local.tolist(), remote.tolist(), strict=True):
            assert n == m
            self.bytes[dst : dst + n] = self.bytes[src : src + n]


def _side(mem: Memory, kv_heads: int, tp: int, page_size: int) -> tuple[KVLayout, list[HeadSlice]]:
    heads = max(1, kv_heads // tp)
    layout = KVLayout(LAYERS, PAGES, page_size, heads, HEAD_DIM, "float32")
    nbytes = PAGES * layout.page_bytes
    return layout, [HeadSlice(start, n, mem.alloc(nbytes)) for start, n in _split(kv_heads, tp)]


def _view(mem: Memory, base: int, layout: KVLayout, b: int) -> np.ndarray:
    """Layer buffer b (K of layers 0..L-1, then V) as [slots, heads, dim]: a copy of the pool's
    [pages, layers, K/V, page_size, heads, dim] slice, for reading."""
    ps, h = layout.page_size, layout.num_kv_heads
    pool = mem.bytes[base : base + PAGES * layout.page_bytes].view(np.float32).reshape(PAGES, LAYERS, 2, ps, h, HEAD_DIM)
    return pool[:, b % LAYERS, b // LAYERS].reshape(PAGES * ps, h, HEAD_DIM)


def _fill(mem: Memory, base: int, layout: KVLayout, b: int, values: np.ndarray) -> None:
    ps, h = layout.page_size, layout.num_kv_heads
    pool = mem.bytes[base : base + PAGES * layout.page_bytes].view(np.float32).reshape(PAGES, LAYERS, 2, ps, h, HEAD_DIM)
    pool[:, b % LAYERS, b // LAYERS] = values.reshape(PAGES, ps, h, HEAD_DIM)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(("kv_heads", "src_tp", "dst_tp"),
                         [(4, 1, 2), (4, 2, 1), (4, 2, 2), (4, 1, 4), (4, 4, 2), (2, 2, 4), (1, 2, 1), (1, 1, 2), (1, 2, 2)])
def test_each_destination_rank_gets_exactly_its_heads(kv_heads: int, src_tp: int, dst_tp: int, page_size: int) -> None:
    mem = Memory()
    src_layout, src = _side(mem, kv_heads, src_tp, page_size)
    dst_layout, dst = _side(mem, kv_heads, dst_tp, page_size)
    assert split_compatible(src_layout, total_heads(src), dst_layout, total_heads(dst)) is None
    rng = np.random.default_rng(0)
    model_kv = rng.standard_normal((2 * LAYERS, PAGES * page_size, kv_heads, HEAD_DIM)).astype(np.float32)
    for s in src:
        for b in range(2 * LAYERS):
            _fill(mem, s.base, src_layout, b, model_kv[b][:, s.start : s.start + s.num])
    src_pages, dst_pages = np.array([1, 2, 4, 5]), np.array([3, 4, 5, 1])  # runs break on both sides
    runs = coalesce_pages(src_pages, dst_pages)
    before = mem.bytes.copy()
    descs = concat_descs([build_sliced_descs(runs, src_layout, src[p.src], dst[p.dst], p) for p in pair_slices(src, dst)])
    mem.apply(descs.local, descs.remote)
    for d in dst:
        for b in range(2 * LAYERS):
            got = _view(mem, d.base, dst_layout, b)
            for sp, dp in zip(src_pages, dst_pages, strict=True):
                want = model_kv[b][sp * page_size : (sp + 1) * page_size, d.start : d.start + d.num]
                np.testing.assert_array_equal(got[dp * page_size : (dp + 1) * page_size], want)
            untouched = np.setdiff1d(np.arange(PAGES), dst_pages)
            for p in untouched:
                assert not got[p * page_size : (p + 1) * page_size].any()
    changed = np.nonzero(mem.bytes != before)[0]
    moved = 2 * LAYERS * len(src_pages) * page_size * HEAD_DIM * 4 * sum(d.num for d in dst)
    assert descs.nbytes == moved and changed.size <= moved
    pairs = pair_slices(src, dst)
    same = sum((src[p.src].start, src[p.src].num) == (dst[p.dst].start, dst[p.dst].num) for p in pairs)
    # 3 page runs: one descriptor each where the slices match; per (token, layer K/V) otherwise
    assert descs.local.shape[0] == same * 3 + (len(pairs) - same) * len(src_pages) * page_size * 2 * LAYERS


def test_mismatched_models_and_bad_slices_are_refused() -> None:
    a = KVLayout(LAYERS, PAGES, 4, 2, HEAD_DIM, "float32")
    assert "KV heads" in (split_compatible(a, 4, a, 2) or "")
    assert "head_dim" in (split_compatible(a, 4, KVLayout(LAYERS, PAGES, 4, 2, 8, "float32"), 4) or "")
    with pytest.raises(ValueError, match="slice"):
        slices_from_wire([[0, 2], [2, 2]], [1], a)  # 2 slices need 2 pool bases
    assert slices_from_wire([], [7], a) == [HeadSlice(0, 2, 7)]
    other = KVLayout(LAYERS, PAGES, 4, 2, HEAD_DIM, "float32", order="layer,kv,page,token,head,dim")
    assert "order" in (split_compatible(a, 2, other, 2) or "")
    with pytest.raises(ValueError, match="at most"):
        slices_from_wire([[0, 2]] * 65, [1] * 65, a)  # a peer cannot make prefill build without bound


def test_descriptor_counts_of_a_1024_token_request_across_tp_pairs() -> None:
    """16 layers, 8 KV heads, page 16, 64 pages in 3 runs: equal splits post one descriptor per run
    and slice pair; mismatched ones one per (token, layer, K/V) and overlapping slice pair."""
    layers, heads = 16, 8
    layout = KVLayout(layers, 512, 16, heads, 64, "bfloat16")
    src_pages = np.array([*range(10, 30), *range(40, 80), *range(100, 104)])
    runs = coalesce_pages(src_pages, np.arange(200, 264))
    assert runs.num_pages.size == 3

    def count(src_tp: int, dst_tp: int) -> int:
        src = [HeadSlice(a, n, 1 << 30) for a, n in _split(heads, src_tp)]
        dst = [HeadSlice(a, n, 1 << 31) for a, n in _split(heads, dst_tp)]
        return sum(build_sliced_descs(runs, layout, src[p.src], dst[p.dst], p).local.shape[0] for p in pair_slices(src, dst))

    assert count(1, 1) == 3 and count(2, 2) == 2 * 3
    assert count(1, 2) == count(2, 1) == 2 * 1024 * 2 * layers  # 65,536 (per-layer buffers: the same)
