"""Host (CPU) memory for the KV pool: one arena, 2 MiB aligned, backed by transparent huge pages.

Why: a KV page is read by attention gathers and, in PD mode, written by the peer
through UCX's CMA transport (process_vm_writev), which pins the target's pages for
every descriptor. With 4 KiB pages a 16 KiB KV page is 4 pins; with a 2 MiB huge
page it is one. Measured on this box (bench/transfer.py): 16 MiB moved in 16 KiB
pages 2.7 -> 4+ GB/s, one contiguous region 4.9 -> 10 GB/s.

    arena (uint8):  |slack| buffer 0 | buffer 1 | ... | buffer n-1 |
                           ^ 2 MiB aligned: every 2 MiB of the buffers can be one huge page

madvise(MADV_HUGEPAGE) is applied before the first touch, so the kernel backs the
arena with huge pages as it is zeroed (when THP is "always" or "madvise"; with
"never", or off Linux, the arena is plain memory and everything still works).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _madvise_hugepage(addr: int, length: int) -> bool:
    if not sys.platform.startswith("linux") or length <= 0:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(addr, length, MADV_HUGEPAGE) != 0:
        logger.info("madvise(MADV_HUGEPAGE) refused (errno %d): KV pool on normal pages", ctypes.get_errno())
        return False
    return True


def _packed_layout(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> tuple[list[int], list[int], int]:
    """Bytes of each tensor, its offset when packed back to back 64-byte aligned, and the total."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [itemsize * math.prod(s) for s in shapes]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += _round_up(size, 64)
    return sizes, offsets, total


def alloc_host_buffers(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Zeroed contiguous CPU tensors of `shapes`, packed back to back (64-byte aligned) in
    one huge-page arena that lives as long as any of them."""
    sizes, offsets, total = _packed_layout(shapes, dtype)
    arena = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)  # untouched: no page is backed yet
    base = arena.data_ptr()
    start = _round_up(base, HUGE_PAGE) - base
    _madvise_hugepage(base + start, total)
    arena[start : start + total].zero_()
    out = []
    for shape, size, off in zip(shapes, sizes, offsets, strict=True):
        out.append(arena[start + off : start + off + size].view(dtype).view(shape))
    return out


def shared_host_buffers(path: str, shapes: list[tuple[int, ...]], dtype: torch.dtype, *, create: bool) -> list[torch.Tensor]:
    """Contiguous CPU tensors of `shapes`, back to back (64-byte aligned) in one MAP_SHARED
    file mapping at `path` (a tmpfs such as /dev/shm: memory, not disk). create=True makes the
    file (zeroed, 0600, must not exist); create=False maps the file another process made, so
    both see the same bytes (a TP decode's rank 0 copies every rank's heads when it retracts)."""
    sizes, offsets, total = _packed_layout(shapes, dtype)
    if create:
        st = os.statvfs(os.path.dirname(path) or ".")
        if st.f_bavail * st.f_frsize < total:  # a tmpfs past its size SIGBUSes on first touch
            raise MemoryError(f"{os.path.dirname(path)} has {st.f_bavail * st.f_frsize / 2**30:.2f} GiB free, the KV "
                              f"pool needs {total / 2**30:.2f} GiB (lower --kv-cache-gb / --max-total-tokens)")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, total)
        finally:
            os.close(fd)
    elif os.path.getsize(path) != total:
        raise ValueError(f"{path} holds {os.path.getsize(path)} bytes, expected {total}")
    arena = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    return [arena[off : off + size].view(dtype).view(shape) for shape, size, off in zip(shapes, sizes, offsets, strict=True)]


__all__ = ["HUGE_PAGE", "alloc_host_buffers", "shared_host_buffers"]
