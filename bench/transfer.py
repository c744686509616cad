"""KV transfer bandwidth/latency through the real KVManager/KVSender/KVReceiver between two
processes (UCX loopback), next to a plain in-process torch copy of the same bytes.

    python bench/transfer.py [--quick] [--reps N]

Layout: 1 layer, K and V buffers, 16 KiB pages (page_size 8 x 8 heads x 128 dim x bf16).
A transfer of B bytes moves B/2 through K and B/2 through V, as (a) one contiguous page
range on both sides (one descriptor per buffer) or (b) randomly scattered 16 KiB pages.
Bandwidth (and the ratio to memcpy) = bytes / (prefill's sender.send() -> decode sees
Success: descriptor build, posts, WRITEs, status message, aux check), as in serving, where
decode's page ids arrive while prefill still computes. Latency = decode's receiver.init() ->
Success, which adds the request message and the prefill's reaction to it. Both clocks are
CLOCK_MONOTONIC (perf_counter), shared by the two processes. Last line: RESULT {json}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

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

PAGE_BYTES = 16 << 10
MIB = 1 << 20


def make(role: str, num_pages: int) -> tuple[KVManager, KVPool]:
    pool = KVPool(num_layers=1, num_pages=num_pages, page_size=8, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    for buf in (*pool.k_buffers, *pool.v_buffers):
        buf.view(torch.uint8).view(-1).copy_(torch.randint(0, 256, (buf.numel() * 2,), dtype=torch.uint8))
    assert pool.layout.page_bytes == PAGE_BYTES
    cfg = TransferConfig(transfer_timeout_s=60, bootstrap_timeout_s=60)
    args = KVManagerArgs(role=role, layout=pool.layout, k_buffers=pool.k_buffers, v_buffers=pool.v_buffers,  # type: ignore[arg-type]
                         aux_buffer=AuxBuffer(8), config=cfg)
    return KVManager(args), pool


def wait(handle: KVSender | KVReceiver, at_least: KVPoll, timeout_s: float = 60.0) -> KVPoll:
    """Blocking (no polling thread competes with the transfer for the 2 cores)."""
    state = handle.wait(at_least, timeout_s)
    if state != KVPoll.Failed and state < at_least:
        raise TimeoutError("bench transfer timed out")
    return state


def prefill_main(conn: Any, num_pages: int) -> None:
    mgr, _ = make("prefill", num_pages)
    conn.send(mgr.bootstrap_port)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            room, src = msg
            sender = mgr.create_sender(f"b{room}", room)
            conn.send("ready")
            wait(sender, KVPoll.WaitingForInput)
            t_send = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
            sender.send(src, is_last=True, aux=AuxRow(first_token=1))
            conn.send((wait(sender, KVPoll.Success) == KVPoll.Success, t_send))
        conn.send(mgr.stats())
    finally:
        mgr.shutdown()


def memcpy_gbps(nbytes: int, reps: int) -> float:
    """Plain torch copy of `nbytes` in one process: the best of 1 thread and torch's default
    threads, each rep on a different (cold) slice of an arena of up to 1 GiB, as a
    transfer touches pool pages that are not in the CPU cache."""
    slots = max(3, min(2 * reps + 2, (1024 * MIB) // nbytes))
    src = torch.randint(0, 256, (slots, nbytes), dtype=torch.uint8)
    dst = torch.ones_like(src)  # written once, so the timed copies take no page faults
    default_threads = torch.get_num_threads()
    best = float("inf")
    for threads in sorted({1, default_threads}):
        torch.set_num_threads(threads)
        for i in range(slots):
            best = min(best, _timed(lambda i=i: dst[i].copy_(src[i])))
    torch.set_num_threads(default_threads)
    return nbytes / best / 1e9


def torch_scatter_gbps(nbytes: int, pool_pages: int, reps: int, rng: np.random.Generator) -> float:
    n = nbytes // PAGE_BYTES
    pool_pages *= 2  # K and V
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 and 16 MiB only, 2 reps")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    sizes = [1, 16] if a.quick else [1, 16, 256]
    reps = 2 if a.quick else a.reps
    torch.set_num_threads(max(1, torch.get_num_threads()))
    pages_needed = max(sizes) * MIB // 2 // PAGE_BYTES
    num_pages = pages_needed * 3 // 2 + 2
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(child, num_pages), daemon=True)
    proc.start()
    mgr = None
    results: dict[str, Any] = {"sizes_mib": sizes, "page_bytes": PAGE_BYTES, "reps": reps, "cases": []}
    try:
        if not conn.poll(120):
            raise TimeoutError("prefill process did not start")
        port = conn.recv()
        mgr, _ = make("decode", num_pages)
        rng = np.random.default_rng(0)
        room = 1
        for mib in sizes:
            n = mib * MIB // 2 // PAGE_BYTES
            mem = memcpy_gbps(mib * MIB, reps)
            for kind in ("contiguous", "scattered"):
                lat, moved = [], []
                for rep in range(reps + 1):  # first rep warms up (connection, page faults)
                    if kind == "contiguous":
                        src, dst = list(range(1, n + 1)), list(range(1, n + 1))
                    else:
                        src = (rng.choice(num_pages - 1, n, replace=False) + 1).tolist()
                        dst = (rng.choice(num_pages - 1, n, replace=False) + 1).tolist()
                    conn.send((room, src))
                    assert conn.recv() == "ready"
                    r = mgr.create_receiver(f"b{room}", room, "127.0.0.1", port)
                    wait(r, KVPoll.WaitingForInput)
                    t0 = time.perf_counter()
                    r.init(dst, 0)
                    wait(r, KVPoll.Success)
                    t1 = time.perf_counter()
                    dt = t1 - t0
                    assert r.poll() == KVPoll.Success, r.failure_reason
                    ok, t_send = conn.recv()
                    assert ok is True
                    room += 1
                    if rep:
                        lat.append(dt)
                        moved.append(t1 - t_send)
                nbytes = 2 * n * PAGE_BYTES
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
        conn.send(None)
        assert conn.recv() is not None
        results["decode_stats"] = mgr.stats()
    finally:
        if mgr is not None:
            mgr.shutdown()
        proc.join(10)
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, 9)
    for case in results["cases"]:
        key = f"ratio_vs_memcpy_{case['mib']}mib_{case['kind']}"
        results[key] = round(case["ratio_vs_memcpy"], 3)
        results[f"gbps_{case['mib']}mib_{case['kind']}"] = round(case["gbps_best"], 3)
    print("RESULT " + json.dumps(results))


if __name__ == "__main__":
    main()
