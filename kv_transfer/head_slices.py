"""KV heads split across tensor-parallel ranks, and WRITE descriptors between two such splits.

Each side of a transfer publishes one HeadSlice per TP rank (TP 1: one slice of every head):
its first KV head, its head count and the base address of its page-major KV pool
(common/cache/kv_pool.py). Within a slice a token's heads are contiguous:

    page p of a slice: [layer 0 K: page_size tokens x (num heads x head_bytes)] [layer 0 V] [layer 1 K] ...
    page_bytes = 2 * L * page_size * num * head_bytes

A prefill split a -> decode split b: every destination slice gets each of its heads from the
first source slice that holds it (with replicated heads, kv_heads < tp, one copy is read and
every replica written). Where the two slices hold the same heads a page run is ONE descriptor
(every layer's K and V); otherwise each (token, layer, K/V) of the run is one descriptor of
the overlapping heads: 2 * L per token. Per-token descriptors were chosen over a staging
gather (copy the heads into a contiguous buffer, send that, scatter on decode): the gather
costs a kernel launch and a second buffer per transfer and an extra pass on decode, and
mismatched TP is the rare deployment. bench/transfer.py measures it ("tp"): on CPU a 1,024-token
request 8 -> 4 heads posts 32,768 descriptors at ~16 us each (0.03 GB/s vs 0.6 GB/s for the
equal split in the same process): a staging gather would pay there and is the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from common.cache.kv_pool import KVLayout
from kv_transfer.descriptors import DescArrays, PageRuns, build_descs

MAX_SLICES = 64  # TP ranks a peer may declare (each costs descriptors on every send)


@dataclass(frozen=True)
class HeadSlice:
    start: int  # first KV head held
    num: int  # KV heads held
    base: int  # address of the slice's page-major KV pool
    device: int = 0  # the GPU holding it (VRAM; 0 on DRAM): TP ranks sit on different GPUs


class HeadPair(NamedTuple):
    src: int  # index of the source slice
    dst: int  # index of the destination slice
    first: int  # heads [first, end) go from src to dst
    end: int


def total_heads(slices: list[HeadSlice]) -> int:
    return max(s.start + s.num for s in slices)


def wire_slices(slices: list[HeadSlice]) -> list[list[int]]:
    """[[start, num], ...] (the bases travel as the message's kv_bases)."""
    return [[s.start, s.num] for s in slices]


def slices_from_wire(
    heads: list[list[int]], kv_bases: list[int], layout: KVLayout, devices: list[int] | None = None
) -> list[HeadSlice]:
    """A peer's slices from its message; no `heads`: one slice of every head. `devices`: each
    slice's GPU (none given: 0). Raises ValueError when the bases do not match the slices."""
    spans = heads or [[0, layout.num_kv_heads]]
    if len(spans) > MAX_SLICES or any(len(span) != 2 for span in spans):
        raise ValueError(f"{len(spans)} head slices (at most {MAX_SLICES} pairs [first head, heads])")
    if len(kv_bases) != len(spans):
        raise ValueError(f"{len(kv_bases)} KV pool bases for {len(spans)} slice(s)")
    if any(num != layout.num_kv_heads or start < 0 for start, num in spans):
        raise ValueError(f"head slices {spans} do not hold {layout.num_kv_heads} heads each")
    devs = devices or [0] * len(spans)
    if len(devs) != len(spans):
        raise ValueError(f"{len(devs)} devices for {len(spans)} slice(s)")
    return [HeadSlice(start, num, kv_bases[i], devs[i]) for i, (start, num) in enumerate(spans)]


def split_compatible(local: KVLayout, local_heads: int, remote: KVLayout, remote_heads: int) -> str | None:
    """None when KV can move between the two splits (same model KV, any TP), else the reason."""
    for name in ("order", "num_layers", "page_size", "head_dim", "dtype"):
        if getattr(local, name) != getattr(remote, name):
            return f"KV layout mismatch: {name} {getattr(local, name)} != {getattr(remote, name)}"
    if local_heads != remote_heads:
        return f"KV layout mismatch: {local_heads} KV heads != {remote_heads}"
    return None


def pair_slices(src: list[HeadSlice], dst: list[HeadSlice]) -> list[HeadPair]:
    """Which source slice writes which heads of each destination slice."""
    pairs = []
    for j, d in enumerate(dst):
        head = d.start
        while head < d.start + d.num:
            i = next(i for i, s in enumerate(src) if s.start <= head < s.start + s.num)
            end = min(src[i].start + src[i].num, d.start + d.num)
            pairs.append(HeadPair(i, j, head, end))
            head = end
    return pairs


def build_sliced_descs(
    runs: PageRuns,
    layout: KVLayout,
    src: HeadSlice,
    dst: HeadSlice,
    pair: HeadPair,
) -> DescArrays:
    """Descriptors writing heads [pair.first, pair.end) of `runs`' pages from src to dst
    (`layout`: page size, head_dim and dtype, which both sides share)."""
    local_dev, remote_dev = src.device, dst.device
    head_bytes = layout.head_dim * layout.itemsize
    ps, blocks = layout.page_size, 2 * layout.num_layers
    if (src.start, src.num) == (dst.start, dst.num):
        page_bytes = blocks * ps * src.num * head_bytes
        return build_descs(runs, page_bytes, [src.base], [dst.base], local_dev, remote_dev)
    counts = runs.num_pages * ps
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    src_tok = np.repeat(runs.src_start * ps, counts) + within  # token slots, in request order
    dst_tok = np.repeat(runs.dst_start * ps, counts) + within
    length = (pair.end - pair.first) * head_bytes

    def offsets(tok: np.ndarray, side: HeadSlice) -> np.ndarray:
        """[blocks, tokens]: byte offset of heads [pair.first, pair.end) of each (layer K/V, token)."""
        row = side.num * head_bytes
        page, off = tok // ps, tok % ps
        first = page * blocks * ps * row + off * row + (pair.first - side.start) * head_bytes
        return first[None, :] + (np.arange(blocks, dtype=np.int64) * ps * row)[:, None]

    src_off, dst_off = offsets(src_tok, src).ravel(), offsets(dst_tok, dst).ravel()
    n = src_off.size
    local = np.empty((n, 3), dtype=np.uint64)
    remote = np.empty((n, 3), dtype=np.uint64)
    local[:, 0] = src_off.astype(np.uint64) + np.uint64(src.base)
    remote[:, 0] = dst_off.astype(np.uint64) + np.uint64(dst.base)
    local[:, 1] = remote[:, 1] = length
    local[:, 2] = local_dev
    remote[:, 2] = remote_dev
    return DescArrays(local, remote, n * length)


def concat_descs(parts: list[DescArrays]) -> DescArrays:
    if len(parts) == 1:
        return parts[0]
    return DescArrays(
        np.concatenate([p.local for p in parts]), np.concatenate([p.remote for p in parts]), sum(p.nbytes for p in parts)
    )
