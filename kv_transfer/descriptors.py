"""Page lists -> coalesced byte runs -> NIXL descriptor arrays.

The i-th source page goes to the i-th destination page. Consecutive pairs that are
contiguous on BOTH sides merge into one run:

    src pages: 7 8 9 | 3 | 4 5
    dst pages: 1 2 3 | 9 | 4 5      (3->9 breaks dst, 9->4 breaks both)
    runs:      (7,1,3) (3,9,1) (4,4,2)   as (src_start, dst_start, num_pages)

Each run becomes one descriptor per registered buffer at byte offset page * page_bytes. The
KV pool is page-major (common/cache/kv_pool.py): one buffer whose page holds every layer's K
and V, so a run is ONE descriptor, every layer included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class ByteRun(NamedTuple):
    src_offset: int
    dst_offset: int
    length: int


class PageRuns(NamedTuple):
    src_start: np.ndarray  # int64 [n]
    dst_start: np.ndarray  # int64 [n]
    num_pages: np.ndarray  # int64 [n]


class DescArrays(NamedTuple):
    local: np.ndarray  # uint64 [n, 3]: (addr, len, dev)
    remote: np.ndarray  # uint64 [n, 3]
    nbytes: int


def coalesce_pages(src_pages: Sequence[int] | np.ndarray, dst_pages: Sequence[int] | np.ndarray) -> PageRuns:
    src = np.asarray(src_pages, dtype=np.int64)
    dst = np.asarray(dst_pages, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"page lists differ in length: {src.shape} vs {dst.shape}")
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return PageRuns(empty, empty, empty)
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.concatenate(([0], np.nonzero(breaks)[0] + 1))
    counts = np.diff(np.concatenate((starts, [src.size])))
    return PageRuns(src[starts], dst[starts], counts)


def coalesce_runs(
    src_pages: Sequence[int] | np.ndarray, dst_pages: Sequence[int] | np.ndarray, page_bytes: int
) -> list[ByteRun]:
    """Pure function: (src page i -> dst page i) as the fewest (src_offset, dst_offset, length) runs."""
    runs = coalesce_pages(src_pages, dst_pages)
    return [
        ByteRun(int(s) * page_bytes, int(d) * page_bytes, int(c) * page_bytes)
        for s, d, c in zip(runs.src_start, runs.dst_start, runs.num_pages, strict=True)
    ]


def build_descs(
    runs: PageRuns,
    page_bytes: int,
    local_bases: Sequence[int],
    remote_bases: Sequence[int],
    local_dev: int = 0,
    remote_dev: int = 0,
) -> DescArrays:
    """One descriptor per (buffer, run), buffer-major: all runs of buffer 0, then buffer 1, ..."""
    if len(local_bases) != len(remote_bases):
        raise ValueError("local and remote buffer counts differ")
    nbuf, nrun = len(local_bases), runs.num_pages.size
    src_off = (runs.src_start * page_bytes).astype(np.uint64)
    dst_off = (runs.dst_start * page_bytes).astype(np.uint64)
    length = (runs.num_pages * page_bytes).astype(np.uint64)
    local = np.empty((nbuf * nrun, 3), dtype=np.uint64)
    remote = np.empty((nbuf * nrun, 3), dtype=np.uint64)
    lb = np.asarray(local_bases, dtype=np.uint64)[:, None]
    rb = np.asarray(remote_bases, dtype=np.uint64)[:, None]
    local[:, 0] = (lb + src_off[None, :]).ravel()
    remote[:, 0] = (rb + dst_off[None, :]).ravel()
    local[:, 1] = remote[:, 1] = np.tile(length, nbuf)
    local[:, 2] = local_dev
    remote[:, 2] = remote_dev
    return DescArrays(local, remote, int(length.sum()) * nbuf)
