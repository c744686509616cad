"""KV transfer bandwidth/latency through the real KVManager/KVSender/KVReceiver between two
processes (UCX loopback), next to a plain in-process torch copy of the same bytes.

    python bench/transfer.py [--quick] [--reps N]
    python bench/transfer.py --device cuda|cpu [--reps N]   the request between two processes on one
                                                            device, timed by a tight poller
                                                            (bench/transfer_device.py; cuda: cuda_ipc)

Two parts, each with its own pair of managers:

request  the realistic one: a Llama-3.2-1B-shaped page-major pool (16 layers, 8 KV heads x 64,
         bf16, page 16: 512 KiB pages), both allocators churned first (requests of 1-40 pages
         come and go), then a 1,024-token request allocated as the schedulers do (prefill in
         two 512-token chunks, decode the whole prompt) and sent in two sends. Reported:
         descriptors per request (prefill's stats delta: KV runs + the aux row) and post ->
         done GB/s (KV bytes / the handles' post start -> NIXL DONE seconds, the metric
         prefill exports) next to a one-thread memcpy of the same 32 MiB (`request_vs_memcpy`:
         UCX over CMA copies in one thread, inside the post) and torch's multi-threaded copy
         (`request_vs_parallel_copy`).
tp       the same request between TP splits in one process (raw NIXL agents): 8 heads -> a
         4-head decode rank (one descriptor per token, layer and K/V: 32,768) vs equal splits.
sizes    1-layer pool with 16 KiB pages (K and V of a page together); B bytes as (a) one
         contiguous page range on both sides or (b) randomly scattered pages. Bandwidth = bytes
         / (prefill's sender.send() -> decode sees Success: descriptor build, posts, WRITEs,
         status message, aux check). Latency = decode's receiver.init() -> Success.

Both clocks are CLOCK_MONOTONIC (perf_counter), shared by the two processes. Last line:
RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.cache import PageAllocator  # noqa: E402
from common.cache.kv_pool import KVPool  # noqa: E402
from kv_transfer import (  # noqa: E402
    AuxBuffer,
    AuxRow,
    KVManager,
    KVManagerArgs,
    KVPoll,
    KVReceiver,
    KVSender,
    TransferConfig,
)
from kv_transfer.descriptors import coalesce_pages  # noqa: E402

PAGE_BYTES = 16 << 10
MIB = 1 << 20
SIZES_POOL = dict(num_layers=1, page_size=8, num_kv_heads=8, head_dim=64)  # 16 KiB pages
REQUEST_POOL = dict(num_layers=16, page_size=16, num_kv_heads=8, head_dim=64)  # 512 KiB pages
REQUEST_TOKENS, REQUEST_CHUNK, REQUEST_PAGES = 1024, 512, 513


def make(role: str, num_pages: int, shape: dict[str, int]) -> tuple[KVManager, KVPool]:
    pool = KVPool(num_pages=num_pages, dtype=torch.bfloat16, **shape)
    raw = pool.kv.view(torch.uint8).view(-1)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    cfg = TransferConfig(transfer_timeout_s=60, bootstrap_timeout_s=60)
    args = KVManagerArgs(role=role, layout=pool.layout, kv_buffer=pool.kv,  # type: ignore[arg-type]
                         aux_buffer=AuxBuffer(8), config=cfg)
    return KVManager(args), pool


def churned(num_pages: int, page_size: int, seed: int) -> PageAllocator:
    """An allocator after requests of 1-40 pages came and went (a third of the pool kept free)."""
    alloc = PageAllocator(num_pages, page_size)
    rng = random.Random(seed)
    held: list[list[int]] = []
    for _ in range(400):
        if held and (rng.random() < 0.45 or alloc.num_free < num_pages // 3):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(alloc.alloc(rng.randint(1, 40)) or [])
    return alloc


def chunk_pages(alloc: PageAllocator, tokens: int, chunk: int) -> list[list[int]]:
    """The pages of a `tokens`-token request allocated in `chunk`-token pieces, as the
    schedulers do (prefill: its chunks; decode: the whole prompt), one list per piece."""
    chunks: list[list[int]] = []
    last = None
    for start in range(0, tokens, chunk):
        slots = alloc.alloc_slots(start, last, chunk, total=tokens)
        assert slots is not None
        chunks.append(alloc.pages_of(slots))
        last = slots[-1]
    return chunks


def wait(handle: KVSender | KVReceiver, at_least: KVPoll, timeout_s: float = 60.0) -> KVPoll:
    """Blocking (no polling thread competes with the transfer for the 2 cores)."""
    state = handle.wait(at_least, timeout_s)
    if state != KVPoll.Failed and state < at_least:
        raise TimeoutError("bench transfer timed out")
    return state


def prefill_main(conn: Any, num_pages: int, shape: dict[str, int]) -> None:
    mgr, _ = make("prefill", num_pages, shape)
    conn.send(mgr.bootstrap_port)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            room, chunks = msg
            sender = mgr.create_sender(f"b{room}", room)
            conn.send("ready")
            wait(sender, KVPoll.WaitingForInput)
            before = mgr.stats()
            t_send = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
            for i, chunk in enumerate(chunks):
                last = i == len(chunks) - 1
                sender.send(chunk, is_last=last, aux=AuxRow(first_token=1) if last else None)
            ok = wait(sender, KVPoll.Success) == KVPoll.Success
            after = mgr.stats()
            delta = {k: after[k] - before[k] for k in ("descriptors", "wire_seconds", "post_seconds", "bytes")}
            conn.send((ok, t_send, delta))
        conn.send(mgr.stats())
    finally:
        mgr.shutdown()


def memcpy_gbps(nbytes: int, reps: int, threads: tuple[int, ...] = ()) -> float:
    """Plain torch copy of `nbytes` in one process: the best of 1 thread and torch's default
    threads, each rep on a different (cold) slice of an arena of up to 1 GiB, as a
    transfer touches pool pages that are not in the CPU cache."""
    slots = max(3, min(2 * reps + 2, (1024 * MIB) // nbytes))
    src = torch.randint(0, 256, (slots, nbytes), dtype=torch.uint8)
    dst = torch.ones_like(src)  # written once, so the timed copies take no page faults
    default_threads = torch.get_num_threads()
    best = float("inf")
    for n in threads or sorted({1, default_threads}):
        torch.set_num_threads(n)
        for i in range(slots):
            best = min(best, _timed(lambda i=i: dst[i].copy_(src[i])))
    torch.set_num_threads(default_threads)
    return nbytes / best / 1e9


def torch_scatter_gbps(nbytes: int, pool_pages: int, reps: int, rng: np.random.Generator) -> float:
    n = nbytes // PAGE_BYTES
    src = torch.randint(0, 256, (pool_pages, PAGE_BYTES), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    si = torch.from_numpy(rng.choice(pool_pages, n, replace=False))
    di = torch.from_numpy(rng.choice(pool_pages, n, replace=False))
    dst.index_copy_(0, di, src.index_select(0, si))
    best = min(_timed(lambda: dst.index_copy_(0, di, src.index_select(0, si))) for _ in range(reps + 1))
    return nbytes / best / 1e9


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Pair:
    """A prefill process and an in-process decode manager over one pool shape."""

    def __init__(self, num_pages: int, shape: dict[str, int]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_main, args=(child, num_pages, shape), daemon=True)
        self.proc.start()
        self.mgr: KVManager | None = None
        self.room = 1
        if not self.conn.poll(120):
            raise TimeoutError("prefill process did not start")
        self.port = self.conn.recv()
        self.mgr, self.pool = make("decode", num_pages, shape)

    def transfer(self, chunks: list[list[int]], dst: list[int]) -> tuple[float, float, dict[str, float]]:
        """(init -> Success, send -> Success, prefill's stats delta) of one request."""
        assert self.mgr is not None
        room, self.room = self.room, self.room + 1
        self.conn.send((room, chunks))
        assert self.conn.recv() == "ready"
        r = self.mgr.create_receiver(f"b{room}", room, "127.0.0.1", self.port)
        wait(r, KVPoll.WaitingForInput)
        t0 = time.perf_counter()
        r.init(dst, 0)
        wait(r, KVPoll.Success)
        t1 = time.perf_counter()
        assert r.poll() == KVPoll.Success, r.failure_reason
        ok, t_send, delta = self.conn.recv()
        assert ok is True
        return t1 - t0, t1 - t_send, delta

    def close(self) -> dict[str, Any]:
        stats: dict[str, Any] = {}
        try:
            self.conn.send(None)
            assert self.conn.recv() is not None
            if self.mgr is not None:
                stats = self.mgr.stats()
        finally:
            if self.mgr is not None:
                self.mgr.shutdown()
            self.proc.join(10)
            if self.proc.is_alive() and self.proc.pid is not None:
                os.kill(self.proc.pid, 9)
        return stats


def request_case(reps: int) -> dict[str, Any]:
    """The 1,024-token request on churned allocators: descriptors and post -> done vs memcpy."""
    ps = REQUEST_POOL["page_size"]
    src_alloc = churned(REQUEST_PAGES, ps, seed=1)
    dst_alloc = churned(REQUEST_PAGES, ps, seed=2)
    pair = Pair(REQUEST_PAGES, REQUEST_POOL)
    kv_bytes = REQUEST_TOKENS // ps * pair.pool.layout.page_bytes
    # one-thread memcpy of the same bytes right after each transfer (same load on the shared box),
    # each rep from a different cold slice
    copy_src = torch.randint(0, 256, (reps + 2, kv_bytes), dtype=torch.uint8)
    copy_dst = torch.ones_like(copy_src)
    descs, wire, post, e2e, copies = [], [], [], [], []
    try:
        for rep in range(reps + 1):  # the first rep warms up (connection, page faults)
            chunks = chunk_pages(src_alloc, REQUEST_TOKENS, REQUEST_CHUNK)
            dst_slots = dst_alloc.alloc_slots(0, None, REQUEST_TOKENS)
            assert dst_slots is not None
            dst = dst_alloc.pages_of(dst_slots)
            _, moved, delta = pair.transfer(chunks, dst)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            copied = _timed(lambda i=rep: copy_dst[i].copy_(copy_src[i]))
            torch.set_num_threads(threads)
            if rep:
                copies.append(copied)
                descs.append(int(delta["descriptors"]))
                wire.append(delta["wire_seconds"])
                post.append(delta["post_seconds"])
                e2e.append(moved)
            src_alloc.free([p for c in chunks for p in c])
            dst_alloc.free(dst)
        stats = pair.close()
    except BaseException:
        pair.close()
        raise
    mem = memcpy_gbps(kv_bytes, reps)
    mem_1t = kv_bytes / min(copies) / 1e9
    best = kv_bytes / min(wire) / 1e9
    case = {
        "tokens": REQUEST_TOKENS, "layers": REQUEST_POOL["num_layers"], "page_size": ps, "kv_bytes": kv_bytes,
        "descriptors": descs, "post_to_done_gbps_best": best,
        "post_to_done_gbps_median": kv_bytes / statistics.median(wire) / 1e9,
        "post_ms_median": statistics.median(post) * 1e3, "send_to_success_ms_median": statistics.median(e2e) * 1e3,
        "memcpy_gbps": mem, "memcpy_1thread_gbps": mem_1t, "decode_stats": stats,
    }
    print(f"request {REQUEST_TOKENS} tokens x {REQUEST_POOL['num_layers']} layers ({kv_bytes / MIB:.0f} MiB): "
          f"{max(descs)} descriptors, post -> done {best:.2f} GB/s best, {case['post_to_done_gbps_median']:.2f} "
          f"median (posting {case['post_ms_median']:.3f} ms); memcpy {mem:.2f} GB/s (1 thread {mem_1t:.2f})",
          flush=True)
    return case


def tp_mismatch_case(reps: int) -> dict[str, Any]:
    """The request's KV between TP splits, posted by one NIXL agent to another in this process:
    prefill TP 1 (8 heads) -> one decode rank of TP 2 (heads 0-3: a per-(token, layer, K/V)
    descriptor each) next to equal splits (one descriptor per page run), same pages."""
    from kv_transfer.faults import FaultInjector, FaultSpec
    from kv_transfer.head_slices import HeadSlice, build_sliced_descs, pair_slices
    from kv_transfer.nixl_endpoint import NixlEndpoint

    ps, heads = REQUEST_POOL["page_size"], REQUEST_POOL["num_kv_heads"]
    pages = REQUEST_TOKENS // ps
    src_pool = KVPool(num_pages=pages + 1, dtype=torch.bfloat16, **REQUEST_POOL)
    half = dict(REQUEST_POOL, num_kv_heads=heads // 2)
    dst_pool = KVPool(num_pages=pages + 1, dtype=torch.bfloat16, **half)
    full_dst = KVPool(num_pages=pages + 1, dtype=torch.bfloat16, **REQUEST_POOL)
    raw = src_pool.kv.view(torch.uint8).view(-1)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    faults = FaultInjector(FaultSpec())
    src = NixlEndpoint("prefill", [src_pool.kv], None, faults)
    dst = NixlEndpoint("decode", [dst_pool.kv, full_dst.kv], None, faults)
    peer = src.add_peer(dst.metadata())
    runs = coalesce_pages(np.arange(1, pages + 1), np.arange(1, pages + 1))
    out: dict[str, Any] = {}
    try:
        for name, dst_slice, dst_pool_ in (("equal", HeadSlice(0, heads, full_dst.kv.data_ptr()), full_dst),
                                           ("tp_mismatch", HeadSlice(0, heads // 2, dst_pool.kv.data_ptr()), dst_pool)):
            src_slices = [HeadSlice(0, heads, src_pool.kv.data_ptr())]
            (pair,) = pair_slices(src_slices, [dst_slice])
            times = []
            for _ in range(reps + 1):
                t0 = time.perf_counter()
                descs = build_sliced_descs(runs, src_pool.layout, src_slices[0], dst_slice, pair)
                xfer = src.post_write(descs.local, descs.remote, "DRAM", peer, descs.nbytes)
                while not src.is_done(xfer):
                    dst.progress()
                times.append(time.perf_counter() - t0)
                src.release(xfer)
            want = src_pool.kv[1:, :, :, :, : dst_slice.num].contiguous().view(torch.uint8)
            assert torch.equal(dst_pool_.kv[1:].view(torch.uint8), want), f"{name}: KV did not land"  # bytes: NaNs
            out[name] = {"descriptors": int(descs.local.shape[0]), "bytes": descs.nbytes,
                         "gbps_best": descs.nbytes / min(times[1:]) / 1e9, "ms_best": min(times[1:]) * 1e3}
            print(f"{name:12s}: {out[name]['descriptors']:6d} descriptors, {descs.nbytes / MIB:5.1f} MiB in "
                  f"{out[name]['ms_best']:7.2f} ms = {out[name]['gbps_best']:5.2f} GB/s (build + post -> done)", flush=True)
    finally:
        src.close()
        dst.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 and 16 MiB only, 2 reps")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="only the 1,024-token request, process to process on this device, tight-polled")
    a = ap.parse_args()
    if a.device is not None:
        from transfer_device import device_request_case

        print("RESULT " + json.dumps(device_request_case(a.device, max(a.reps, 20 if a.device == "cuda" else 3))))
        return
    sizes = [1, 16] if a.quick else [1, 16, 256]
    reps = 2 if a.quick else a.reps
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results: dict[str, Any] = {"sizes_mib": sizes, "page_bytes": PAGE_BYTES, "reps": reps, "cases": []}
    request = request_case(reps)
    results["request"] = request
    results["descriptors_per_request"] = max(request["descriptors"])
    results["request_post_to_done_gbps"] = round(request["post_to_done_gbps_best"], 3)
    # memcpy = one thread copying the same bytes (what UCX's CMA does in one process_vm_writev);
    # next to torch's multi-threaded copy too, which one transfer cannot use
    results["request_vs_memcpy"] = round(request["post_to_done_gbps_best"] / request["memcpy_1thread_gbps"], 3)
    results["request_vs_parallel_copy"] = round(request["post_to_done_gbps_best"] / request["memcpy_gbps"], 3)
    tp = tp_mismatch_case(reps)
    results["tp"] = tp
    results["tp_mismatch_descriptors"] = tp["tp_mismatch"]["descriptors"]
    results["tp_mismatch_gbps"] = round(tp["tp_mismatch"]["gbps_best"], 3)
    num_pages = max(sizes) * MIB // PAGE_BYTES * 3 // 2 + 2
    pair = Pair(num_pages, SIZES_POOL)
    assert pair.pool.layout.page_bytes == PAGE_BYTES
    try:
        rng = np.random.default_rng(0)
        for mib in sizes:
            n = mib * MIB // PAGE_BYTES
            mem = memcpy_gbps(mib * MIB, reps)
            for kind in ("contiguous", "scattered"):
                lat, moved = [], []
                for rep in range(reps + 1):  # first rep warms up (connection, page faults)
                    if kind == "contiguous":
                        src, dst = list(range(1, n + 1)), list(range(1, n + 1))
                    else:
                        src = (rng.choice(num_pages - 1, n, replace=False) + 1).tolist()
                        dst = (rng.choice(num_pages - 1, n, replace=False) + 1).tolist()
                    dt, sent, _ = pair.transfer([src], dst)
                    if rep:
                        lat.append(dt)
                        moved.append(sent)
                nbytes = n * PAGE_BYTES
                case = {
                    "mib": mib, "kind": kind,
                    "gbps_best": nbytes / min(moved) / 1e9, "gbps_median": nbytes / statistics.median(moved) / 1e9,
                    "gbps_incl_request_best": nbytes / min(lat) / 1e9,
                    "latency_ms_best": min(lat) * 1e3, "latency_ms_median": statistics.median(lat) * 1e3,
                    "send_to_success_ms_best": min(moved) * 1e3,
                    "memcpy_gbps": mem,
                }
                if kind == "scattered":
                    case["torch_scatter_gbps"] = torch_scatter_gbps(nbytes, num_pages, reps, rng)
                case["ratio_vs_memcpy"] = case["gbps_best"] / mem
                results["cases"].append(case)
                print(f"{mib:4d} MiB {kind:10s}: {case['gbps_best']:6.2f} GB/s best, {case['gbps_median']:6.2f} median "
                      f"(send -> Success {case['send_to_success_ms_best']:7.2f} ms); with decode's request "
                      f"{case['latency_ms_best']:7.2f} ms = {case['gbps_incl_request_best']:5.2f} GB/s; "
                      f"torch copy {mem:6.2f} GB/s; ratio {case['ratio_vs_memcpy']:.2f}", flush=True)
        results["decode_stats"] = pair.close()
    except BaseException:
        pair.close()
        raise
    for case in results["cases"]:
        key = f"ratio_vs_memcpy_{case['mib']}mib_{case['kind']}"
        results[key] = round(case["ratio_vs_memcpy"], 3)
        results[f"gbps_{case['mib']}mib_{case['kind']}"] = round(case["gbps_best"], 3)
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
