"""`bench/transfer.py --device cuda|cpu`: the 1,024-token request of the Llama-3.2-1B shape
(16 layers, 8 KV heads x 64, bf16, page 16: 512 KiB pages, 32 MiB of KV) WRITTEN by one process's
NIXL agent into another process's pool on the same device (cuda: both pools on GPU 0, so UCX
takes cuda_ipc; cpu: DRAM, UCX's cma/posix), timed by a dedicated tight poller.

Why not the engine's clock: prefill's transfer thread notices DONE through a 1 ms poll and the
GIL, so its `wire_gbps` measures the noticing, not the copy. Here the posting process does
nothing but post the request's descriptors (built as prefill builds them: churned allocators on
both sides, pages coalesced into runs, kv_transfer.head_slices.build_sliced_descs) and spin on
check_xfer_state until DONE. post -> done = bytes / (posting starts -> DONE seen); `post_ms` is
the part inside NIXL's transfer() call. The target process only drives its UCX worker. The bytes
are checked (sha256 of the source pages vs the destination pages, last rep). Next to it: the
same bytes copied on the device inside one process (`device_copy_gbps`: torch copy_ of 32 MiB,
contiguous; the ceiling a transfer could approach).

Last line: RESULT {json} with post_to_done_gbps_best / _median, descriptors, kv_bytes, post_ms.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch

from common.cache.kv_pool import KVPool
from kv_transfer.descriptors import coalesce_pages
from kv_transfer.faults import FaultInjector, FaultSpec
from kv_transfer.head_slices import HeadSlice, build_sliced_descs, pair_slices

POOL = dict(num_layers=16, page_size=16, num_kv_heads=8, head_dim=64)  # the 1B shape: 512 KiB pages
TOKENS, NUM_PAGES = 1024, 513


def _pool(device: str) -> KVPool:
    return KVPool(num_pages=NUM_PAGES, dtype=torch.bfloat16, device=device, **POOL)  # type: ignore[arg-type]


def _digest(pool: KVPool, pages: list[int]) -> str:
    rows = pool.kv[torch.tensor(pages, device=pool.kv.device)].contiguous().view(torch.uint8).cpu()
    return hashlib.sha256(rows.numpy().tobytes()).hexdigest()


def target_main(conn: Any, device: str) -> None:
    """The decode side: a pool, a NIXL agent, its UCX worker driven until told to stop."""
    from kv_transfer.nixl_endpoint import NixlEndpoint

    pool = _pool(device)
    ep = NixlEndpoint("decode", [pool.kv], None, FaultInjector(FaultSpec()))
    conn.send((ep.metadata(), pool.kv.data_ptr()))
    try:
        while True:
            if conn.poll(0.0002):
                msg = conn.recv()
                if msg is None:
                    break
                if device == "cuda":
                    torch.cuda.synchronize()
                conn.send(_digest(pool, msg))  # msg: destination pages, in request order
            ep.progress()
    finally:
        ep.close()


def _pages(seed: int, chunk: int) -> list[int]:
    """The request's 64 pages on an allocator churned like a serving pool, allocated in `chunk`-
    token pieces as the schedulers do (prefill: two 512-token chunks; decode: the whole prompt),
    exactly as bench/transfer.py's request case."""
    from transfer import chunk_pages, churned

    return [p for piece in chunk_pages(churned(NUM_PAGES, POOL["page_size"], seed=seed), TOKENS, chunk) for p in piece]


def device_copy_gbps(nbytes: int, device: str, reps: int) -> float:
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def device_request_case(device: str, reps: int) -> dict[str, Any]:
    from kv_transfer.nixl_endpoint import NixlEndpoint

    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=target_main, args=(child, device), daemon=True)
    proc.start()
    src_pool = _pool(device)
    raw = src_pool.kv.view(torch.uint8).view(-1)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=device))
    ep = NixlEndpoint("prefill", [src_pool.kv], None, FaultInjector(FaultSpec()))
    try:
        if not conn.poll(120):
            raise TimeoutError("target process did not start")
        meta, dst_base = conn.recv()
        peer = ep.add_peer(meta)
        src_pages, dst_pages = _pages(1, 512), _pages(2, TOKENS)
        heads = POOL["num_kv_heads"]
        s, d = HeadSlice(0, heads, src_pool.kv.data_ptr()), HeadSlice(0, heads, dst_base)
        (pair,) = pair_slices([s], [d])
        descs = build_sliced_descs(coalesce_pages(src_pages, dst_pages), src_pool.layout, s, d, pair)
        if device == "cuda":
            torch.cuda.synchronize()
        moved, posts = [], []
        for _ in range(reps + 1):  # the first rep warms up (UCX wireup, IPC handle mapping)
            xfer = ep.post_write(descs.local, descs.remote, ep.kv_mem_type, peer, descs.nbytes)
            while not ep.is_done(xfer, inject=False):  # the tight poller: nothing else in between
                pass
            done = time.monotonic()
            ep.release(xfer)
            moved.append(done - xfer.posted_at)
            posts.append(xfer.post_s)
        conn.send(dst_pages)
        if not conn.poll(120):
            raise TimeoutError("target process did not answer the byte check")
        landed = conn.recv() == _digest(src_pool, src_pages)
        conn.send(None)
    finally:
        ep.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    assert landed, "the KV bytes did not land where the descriptors say"
    moved, posts = moved[1:], posts[1:]
    copy = device_copy_gbps(descs.nbytes, device, reps)
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "mem_type": ep.kv_mem_type,
        "tokens": TOKENS, "layers": POOL["num_layers"], "kv_bytes": descs.nbytes,
        "descriptors": int(descs.local.shape[0]), "reps": reps, "bytes_checked": landed,
        "post_to_done_gbps_best": round(descs.nbytes / min(moved) / 1e9, 3),
        "post_to_done_gbps_median": round(descs.nbytes / statistics.median(moved) / 1e9, 3),
        "post_to_done_ms_median": round(statistics.median(moved) * 1e3, 4),
        "post_ms_median": round(statistics.median(posts) * 1e3, 4),
        "device_copy_gbps": round(copy, 1),
    }
    print(f"{device}: {TOKENS} tokens x {POOL['num_layers']} layers ({descs.nbytes / 2**20:.0f} MiB, "
          f"{result['descriptors']} descriptors): post -> done {result['post_to_done_gbps_best']:.1f} GB/s best, "
          f"{result['post_to_done_gbps_median']:.1f} median ({result['post_to_done_ms_median']:.3f} ms, posting "
          f"{result['post_ms_median']:.3f} ms); device copy {copy:.1f} GB/s", flush=True)
    return result

