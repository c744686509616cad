"""Prefill engine RSS per request under oneDNN primitive cache settings (issue 41 item 6).

Each mode is one offline engine in its own spawned process (the oneDNN cache capacity is read
from ONEDNN_PRIMITIVE_CACHE_CAPACITY when torch creates its first primitive, so it must be set
before the engine starts). The parent steps the modes in lockstep, one request each in turn,
so only one engine computes at a time and every mode sees the same box load (alternated, same
run). Each request is a random prompt of --min-len..--max-len tokens with 1 new token, as a
prefill instance sees them; "bucketed" rounds each prompt up to a multiple of --bucket tokens,
which is what padding chunks to buckets would cost (its tokens/s counts the real tokens only).

    python bench/prefill_memory.py --requests 120 --warmup 40
    ... RESULT {"rss_mib_per_1000_requests_after_warmup": {...}, "prefill_tok_s": {...}, ...}
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from machine_info import cpu_name


@dataclass(frozen=True)
class Mode:
    name: str
    cache_capacity: int | None  # None: leave the env as the process found it
    bucket: int = 0  # round prompt lengths up to a multiple of this (0: as drawn)
    row_bucket: int = 0  # --cpu-prefill-row-bucket of the engine (0: off)
    mmap_threshold: int = 0  # MALLOC_MMAP_THRESHOLD_ of the engine process, bytes (0: glibc's dynamic one)
    attn_pad: int = 0  # bf16/fp16 extend attention padded to this many rows (0: the engine's own, 1: none)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def child(mode: Mode, model_path: str | None, dtype: str, conn: Connection) -> None:
    """Runs in the spawned process: answers each prompt length with (rss MiB, seconds)."""
    if mode.cache_capacity is None:
        os.environ.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
    else:
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(mode.cache_capacity)
    from common.engine import Engine
    from common.model.attention import torch_backend

    if mode.attn_pad:
        torch_backend.REDUCED_PRECISION_EXTEND_PAD = mode.attn_pad

    engine = Engine(model_path=model_path, dtype=dtype, page_size=16, chunked_prefill_size=512,
                    max_total_tokens=16384, max_running_requests=8,
                    cpu_prefill_row_bucket=mode.row_bucket)
    rng = random.Random(1)
    conn.send("ready")
    while (n := conn.recv()) is not None:
        ids = [rng.randrange(100, 40000) for _ in range(n)]
        t0 = time.perf_counter()
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0})
        conn.send((rss_mib(), time.perf_counter() - t0))
    engine.shutdown()


def slope_per_1000(rss: list[float]) -> float:
    """Least-squares MiB per request over the given samples, times 1,000."""
    n = len(rss)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(rss) / n
    num = sum((i - mx) * (y - my) for i, y in enumerate(rss))
    den = sum((i - mx) ** 2 for i in range(n))
    return num / den * 1000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=40, help="requests left out of the slope")
    ap.add_argument("--min-len", type=int, default=300)
    ap.add_argument("--max-len", type=int, default=800)
    ap.add_argument("--bucket", type=int, default=64)
    ap.add_argument("--modes", default="default,cache16,cache64,bucketed",
                    help="default, cacheN (ONEDNN_PRIMITIVE_CACHE_CAPACITY=N), bucketed (prompts rounded up to "
                         "--bucket), rowsN (--cpu-prefill-row-bucket N), mmapN (MALLOC_MMAP_THRESHOLD_=N bytes), attnpadN (bf16 "
                         "extend attention padded to N rows; 1: unpadded); '+' combines: cache16+rows64")
    return ap.parse_args(argv)


def make_mode(name: str, bucket: int) -> Mode:
    """default | cacheN | bucketed | rowsN (--cpu-prefill-row-bucket N) | mmapN | attnpadN; joined with '+'."""
    cache, prompt_bucket, rows, mmap, attn_pad = None, 0, 0, 0, 0
    for part in name.split("+"):
        if part.startswith("cache"):
            cache = int(part.removeprefix("cache"))
        elif part.startswith("rows"):
            rows = int(part.removeprefix("rows"))
        elif part.startswith("mmap"):
            mmap = int(part.removeprefix("mmap"))
        elif part.startswith("attnpad"):
            attn_pad = int(part.removeprefix("attnpad"))
        elif part == "bucketed":
            prompt_bucket = bucket
        elif part != "default":
            raise SystemExit(f"unknown mode {name!r}")
    return Mode(name, cache, prompt_bucket, rows, mmap, attn_pad)


def main(argv: list[str] | None = None) -> None:
    import multiprocessing

    args = parse_args(argv)
    modes = [make_mode(m, args.bucket) for m in args.modes.split(",")]
    ctx = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    for mode in modes:
        parent, kid = ctx.Pipe()
        proc = ctx.Process(target=child, args=(mode, args.model_path, args.dtype, kid), daemon=True)
        # glibc reads it when the process starts: the spawned child inherits it from here
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        if mode.mmap_threshold:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = str(mode.mmap_threshold)
        proc.start()
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        pipes.append(parent)
        procs.append(proc)
    for p in pipes:
        if not p.poll(600):
            raise SystemExit("an engine did not start within 600 s")
        p.recv()
    rng = random.Random(0)
    rss: dict[str, list[float]] = {m.name: [] for m in modes}
    secs: dict[str, float] = {m.name: 0.0 for m in modes}
    real_tokens = 0
    for i in range(args.requests):
        n = rng.randint(args.min_len, args.max_len)
        if i >= args.warmup:
            real_tokens += n
        for mode, p in zip(modes, pipes, strict=True):
            p.send(-(-n // mode.bucket) * mode.bucket if mode.bucket else n)
            if not p.poll(300):
                raise SystemExit(f"{mode.name}: no answer within 300 s")
            r, s = p.recv()
            rss[mode.name].append(r)
            if i >= args.warmup:
                secs[mode.name] += s
        if i % 20 == 0 or i == args.requests - 1:
            print(f"[{i}] " + "  ".join(f"{m}: {v[-1]:.0f} MiB" for m, v in rss.items()), flush=True)
    for p, proc in zip(pipes, procs, strict=True):
        p.send(None)
        proc.join(60)
    after = slice(args.warmup, None)
    result: dict[str, Any] = {
        "rss_mib_per_1000_requests_after_warmup": {m: round(slope_per_1000(v[after]), 1) for m, v in rss.items()},
        "rss_mib_at_warmup": {m: round(v[args.warmup - 1], 1) for m, v in rss.items()},
        "rss_mib_end": {m: round(v[-1], 1) for m, v in rss.items()},
        "prefill_tok_s": {m: round(real_tokens / secs[m], 1) for m in secs},
        "requests": args.requests, "warmup": args.warmup, "dtype": args.dtype,
        "prompt_len": [args.min_len, args.max_len], "cpu": cpu_name(),
        "load_avg": round(os.getloadavg()[0], 2),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
